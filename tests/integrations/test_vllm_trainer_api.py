"""vLLM's trainer-side API with refitflow as its backend: ``WeightTransferTrainerFactory.trainer_init`` with
``RefitflowTrainerInitInfo``, vLLM's ``ModuleSource`` and ``HTTPVLLMWeightSyncClient`` (vLLM 0.33's own
classes), two trainer ranks (threads of this process, each with its own copy of the model: rank 0 serves the
registry, rank 1 is given its address), against a real vLLM CPU server that is given nothing but the
backend's name. Each ``send_weights`` publishes the live parameters (each replicated tensor from one rank)
and drives start → update (no drain) → finish; the server's greedy tokens are then the trainer model's."""

from __future__ import annotations

import multiprocessing
import pathlib
import threading
from typing import Any

import anyio
import anyio.to_thread
import pytest
import torch
import transformers as tf
from vllm.distributed.weight_transfer.base import ModuleSource
from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

import refitflow as rf
from refitflow.integrations.vllm.trainer import RefitflowTrainerEngine, RefitflowTrainerInitInfo
from tests.integrations import _trainer_api_rank
from tests.integrations._hf_trainer import expected
from tests.integrations._vllm_cpu import VllmServer, free_ports
from tests.integrations._vllm_real import PROMPT, TOKENS, Greedy, llama_checkpoint

DEADLINE_S = 600.0
SPEC = {"prompt": PROMPT, "tokens": TOKENS, "dtype": "float32"}


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return llama_checkpoint(tmp_path_factory.mktemp("llama"))


def fresh(config: tf.PretrainedConfig, seed: int) -> tf.PreTrainedModel:
    torch.manual_seed(seed)
    return tf.LlamaForCausalLM(config).eval()


def on_every_rank(engines: list[Any], method: str) -> list[BaseException | None]:
    """``method`` on every rank at once (each in its own thread, as each trainer process would); the errors."""
    errors: list[BaseException | None] = [None] * len(engines)

    def run(rank: int) -> None:
        try:
            getattr(engines[rank], method)()
        except BaseException as exc:
            errors[rank] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(engines))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


@pytest.mark.asyncio
async def test_vllms_trainer_api_refits_a_real_server_through_refitflow(
    llama: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    with anyio.fail_after(DEADLINE_S):
        config = tf.AutoConfig.from_pretrained(llama)
        models = [fresh(config, seed=1) for _ in range(2)]  # rank r's copy
        server = VllmServer(llama, dtype="float32", log_path=tmp_path / "vllm.log", flags=("--enable-scale-out",),
                            max_model_len=512)  # fmt: skip
        engines: list[Any] = []
        async with server:
            client = HTTPVLLMWeightSyncClient(server.url, timeout=120)

            def init(rank: int, registry: str | None) -> Any:
                info = RefitflowTrainerInitInfo(rank=rank, world_size=2, model="tiny-real", registry=registry,
                                                registry_bind="tcp://127.0.0.1:*", timeout_s=60,
                                                worker_init={"budget_bytes": 1 << 20})  # fmt: skip
                return WeightTransferTrainerFactory.trainer_init(info, client=client, source=ModuleSource(models[rank]))

            try:
                engines.append(await anyio.to_thread.run_sync(init, 0, None))
                assert isinstance(engines[0], RefitflowTrainerEngine) and engines[0].is_sender
                engines.append(await anyio.to_thread.run_sync(init, 1, engines[0].registry_address))
                for version, seed in ((1, 1), (2, 2)):
                    if seed != 1:
                        for model in models:  # the optimizer's step: the live parameters change in place
                            with torch.no_grad():
                                for mine, new in zip(model.parameters(), fresh(config, seed).parameters(),
                                                     strict=True):  # fmt: skip
                                    mine.copy_(new)
                    assert await anyio.to_thread.run_sync(on_every_rank, engines, "send_weights") == [None, None]
                    want = Greedy(*expected(models[0], SPEC))
                    got = await server.tokens(PROMPT, TOKENS)
                    assert want.matches(got, "float32"), (got, want)
                    assert (await server.http.get("/weight_info")).json() == {"weight_version": str(version)}
                published = [engine.publisher.published for engine in engines]
                assert published == [[1, 2], [1, 2]]  # both ranks published each version (each half the tensors)

                # a server that cannot take the version: the sender says which call failed and the server's answer
                assert (await server.post("/shutdown_weight_transfer_engine")).status_code == 200
                engines[1].info.timeout_s = 5
                errors = await anyio.to_thread.run_sync(on_every_rank, engines, "send_weights")
                assert isinstance(errors[0], rf.RefitError) and "start_weight_update failed" in str(errors[0])
                assert "not initialised" in str(errors[0]), errors[0]  # the server's own answer, in the error
                # without a process group rank 1 cannot hear the sender: it returns at the release or its deadline
                assert errors[1] is None or isinstance(errors[1], rf.RefitTimeoutError), errors[1]
            finally:
                for engine in engines:
                    await anyio.to_thread.run_sync(engine.shutdown)


def test_the_trainer_init_info_refuses_what_cannot_work() -> None:
    with pytest.raises(rf.ConfigError, match="rank 2 must lie in"):
        RefitflowTrainerInitInfo(rank=2, world_size=2)
    with pytest.raises(rf.ConfigError, match="no_drain needs mode='shadow'"):
        RefitflowTrainerInitInfo(rank=0, mode="in_place")
    with pytest.raises(rf.ConfigError, match="pass source="):
        WeightTransferTrainerFactory.trainer_init(RefitflowTrainerInitInfo(rank=0), client=None)  # type: ignore[arg-type]


@pytest.mark.asyncio
async def test_two_fsdp2_trainer_processes_send_their_shards_through_vllms_trainer_api(
    llama: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    """Two trainer processes in a gloo group, the model ``fully_shard``-ed over them: each publishes its DTensor
    shards (``ModuleSource``, no gather); rank 0 serves the registry and shares its address over the group, and
    a server's refusal reaches both ranks."""
    with anyio.fail_after(DEADLINE_S):
        server = VllmServer(llama, dtype="float32", log_path=tmp_path / "vllm.log", flags=("--enable-scale-out",),
                            max_model_len=512)  # fmt: skip
        async with server:
            ctx = multiprocessing.get_context("spawn")
            queue, go = ctx.Queue(), ctx.Queue()
            init = f"tcp://127.0.0.1:{free_ports(1)[0]}"
            ranks = [ctx.Process(target=_trainer_api_rank.main, args=(r, init, str(llama), server.url, queue, go))
                     for r in range(2)]  # fmt: skip
            for p in ranks:
                p.start()
            try:
                for version in _trainer_api_rank.VERSIONS:
                    event = await anyio.to_thread.run_sync(queue.get, True, 240)
                    assert event[0] == "sent" and event[1] == version, event
                    want = Greedy(event[2], event[3])
                    got = await server.tokens(PROMPT, TOKENS)
                    assert want.matches(got, "float32"), (version, got, want)
                    assert (await server.http.get("/weight_info")).json() == {"weight_version": str(version)}
                    go.put(True)
                # a server that cannot take the next version: the sender's failure reaches both ranks over the group
                assert (await server.post("/shutdown_weight_transfer_engine")).status_code == 200
                go.put(True)
                failed = sorted([await anyio.to_thread.run_sync(queue.get, True, 240) for _ in range(2)])
                assert [(e[0], e[1]) for e in failed] == [("failed", 0), ("failed", 1)], failed
                assert all("RefitError" in e[2] and "start_weight_update failed" in e[2] for e in failed), failed
                for p in ranks:
                    await anyio.to_thread.run_sync(p.join, 60)
                    assert p.exitcode == 0, p.exitcode
            finally:
                for p in ranks:
                    if p.is_alive():
                        p.kill()
