"""vLLM's RL routes in a real HTTP server process (vLLM's router, FastAPI, uvicorn) with refitflow's backend
behind them (``_vllm_server``: vLLM's worker update methods over two TP workers), driven by vLLM's own
``HTTPVLLMWeightSyncClient`` and by refitflow's ``VllmFleet``. The trainer is a Megatron publisher process.
vLLM must be installed (``.ci/engines-cpu.sh``): without it these tests fail.
"""

from __future__ import annotations

import json
import sys
from typing import Any, Self

import anyio
import anyio.to_thread
import httpx
import pytest
import requests
import vllm  # noqa: F401  (a missing vLLM fails here, loudly)
from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient

from refitflow.integrations.hosting.info import RefitflowInitInfo
from refitflow.integrations.vllm.driver.checksums import expected_checksums
from refitflow.integrations.vllm.driver.fleet import VllmFleet
from tests.conftest import free_ports
from tests.integrations._tiny import canonical, dims
from tests.integrations.test_vllm_backend import ROOT, Trainer
from tests.transports._nixl_peer import LineChild


class Server(LineChild):
    def __init__(self, tp: int = 2, lose_verdict: int | None = None) -> None:
        spec = json.dumps({"kind": "qwen2", "tp": tp, "lose_verdict": lose_verdict})
        super().__init__([sys.executable, "-m", "tests.integrations._vllm_server", spec], path=[ROOT])

    async def __aenter__(self) -> Self:
        await super().__aenter__()
        self.url = str((await self._ask(None))["url"])
        return self


def info(registry: str, **extra: Any) -> RefitflowInitInfo:
    return RefitflowInitInfo(
        registry=registry, model="tiny-vllm", identity={"layout": "megatron"}, budget_bytes=1 << 16,
        vote_addresses=[f"tcp://127.0.0.1:{p}" for p in free_ports(2)], vote_timeout_s=20, **extra,
    )  # fmt: skip


def checksums_of(version: int) -> dict[str, str]:
    return expected_checksums(canonical("qwen2", version), dims("qwen2"), tp=2)


@pytest.mark.asyncio
async def test_vllms_own_client_drives_the_whole_sequence_and_the_weight_checker_agrees() -> None:
    with anyio.fail_after(300):
        async with Trainer("qwen2") as trainer, Server() as server, httpx.AsyncClient(base_url=server.url) as http:
            client = HTTPVLLMWeightSyncClient(server.url, timeout=120)
            await anyio.to_thread.run_sync(client.init_weight_transfer_engine, info(trainer.registry).to_dict())
            await trainer.publish(1, seed=1)
            assert (await http.post("/pause", params={"mode": "keep"})).json() == {"status": "paused"}
            await anyio.to_thread.run_sync(client.start_weight_update)
            await anyio.to_thread.run_sync(client.update_weights, {"version": 1, "timeout_s": 60})
            await anyio.to_thread.run_sync(client.finish_weight_update, "1")
            await http.post("/resume")
            assert (await http.get("/weight_info")).json() == {"weight_version": "1"}
            compare = await http.post("/weight_checker", json={"action": "compare", "baseline": checksums_of(1)})
            assert compare.json() == {"match": True, "mismatches": []}
            stale = await http.post("/weight_checker", json={"action": "compare", "baseline": checksums_of(2)})
            assert not stale.json()["match"]  # the checksums tell versions apart

            await trainer.publish(2, seed=2, corrupt=0)  # a byte of TP rank 0's slice
            await anyio.to_thread.run_sync(client.start_weight_update)
            with pytest.raises(requests.HTTPError, match="500"):
                await anyio.to_thread.run_sync(client.update_weights, {"version": 2, "timeout_s": 60})
            with pytest.raises(requests.HTTPError):  # vLLM closed the failed update on every worker
                await anyio.to_thread.run_sync(client.finish_weight_update, "2")
            assert (await http.post("/weight_checker", json={"action": "compare", "baseline": checksums_of(1)})
                    ).json()["match"] is False  # in place and failed: fenced, not version 1 any more  # fmt: skip
            await anyio.to_thread.run_sync(client.start_weight_update)  # the next update starts cleanly
            await trainer.publish(3, seed=3)
            await anyio.to_thread.run_sync(client.update_weights, {"version": 3, "timeout_s": 60})
            await anyio.to_thread.run_sync(client.finish_weight_update, "3")
            compare = await http.post("/weight_checker", json={"action": "compare", "baseline": checksums_of(3)})
            assert compare.json() == {"match": True, "mismatches": []}
            await anyio.to_thread.run_sync(client.shutdown_weight_transfer_engine)


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", ["in_place", "shadow"])
async def test_the_fleet_driver_sees_a_failing_update_as_a_failure_and_fences_only_in_place(mode: str) -> None:
    with anyio.fail_after(300):
        async with Trainer("qwen2") as trainer, Server() as server, httpx.AsyncClient(base_url=server.url) as http:
            init = info(trainer.registry, mode=mode)
            fleet = VllmFleet.for_backend({"a": server.url}, init)
            await fleet.init(init)
            await trainer.publish(1, seed=1)
            result = (await fleet.refit(1, timeout_s=60))["a"]
            assert result.committed and result.version == 1, result
            assert await fleet.compare(checksums_of(1)) == {"a": []}

            await trainer.publish(2, seed=2, corrupt=1)
            result = (await fleet.refit(2, timeout_s=60))["a"]
            assert not result.committed and "update_weights: 500" in (result.ranks[0].error or ""), result
            paused = (await http.get("/is_paused")).json()["is_paused"]
            if mode == "in_place":  # fenced: left paused, so it serves no half-written model
                assert paused and result.ranks[0].fence == "fenced" and fleet.paused == {"a"}
            else:  # the previous version serves on: resumed, and still version 1 exactly
                assert not paused and result.ranks[0].fence == "ready"
                assert await fleet.compare(checksums_of(1)) == {"a": []}

            await trainer.publish(3, seed=3)
            result = (await fleet.refit(3, timeout_s=60))["a"]
            assert result.committed and result.version == 3 and not fleet.paused, result
            assert not (await http.get("/is_paused")).json()["is_paused"]
            assert await fleet.compare(checksums_of(3)) == {"a": []}
            await fleet.shutdown()


@pytest.mark.asyncio
async def test_a_worker_in_doubt_keeps_even_a_shadow_server_paused_until_the_next_update_resolves_it() -> None:
    """Worker 1 loses the first verdict: the update is a failure saying so; the fleet finishes the update on
    worker 0 (which learned COMMIT and kept vLLM's update open), so the server would serve two versions:
    it stays paused. The next update: worker 1 learns the verdict first, both commit."""
    with anyio.fail_after(300):
        async with Trainer("qwen2") as trainer, Server(lose_verdict=1) as server:
            init = info(trainer.registry, mode="shadow")
            fleet = VllmFleet.for_backend({"a": server.url}, init)
            await fleet.init(init)
            await trainer.publish(1, seed=1)
            result = (await fleet.refit(1, timeout_s=60))["a"]
            assert not result.committed and "in doubt" in (result.ranks[0].error or ""), result
            assert fleet.paused == {"a"} and result.ranks[0].fence == "fenced"
            mismatches = (await fleet.compare(checksums_of(1)))["a"]
            assert mismatches and all(k.startswith("dp0:pp0:pcp0:tp1:") for k in mismatches)  # worker 0 has v1

            await trainer.publish(2, seed=2)
            result = (await fleet.refit(2, timeout_s=60))["a"]
            assert result.committed and result.version == 2 and not fleet.paused, result
            assert await fleet.compare(checksums_of(2)) == {"a": []}
            await fleet.shutdown()
