"""refitflow as SGLang 0.5.23's custom weight loader, behind SGLang's real HTTP app, over real HTTP.

The server (``_sglang_server``) serves ``sglang.srt.entrypoints.http_server.app`` with two scheduler
processes behind it (``_sglang_rank``: SGLang's own weight-update code, plugin loader and gloo groups;
a ``FusedModel`` with SGLang's Qwen2 names and shapes per TP rank). The trainer is a Megatron-layout
publisher in another process, read over NIXL. SGLang must be installed (``.ci/engines-cpu.sh``, with
``.ci/sglang-cpu.txt``); it runs on this CPU machine with one stub, for its torchvision import
(``_sglang_stub``). Without SGLang these tests fail.
"""

from __future__ import annotations

import json
import pathlib
import sys
import tomllib
from typing import Any, Self

import anyio
import httpx
import pytest
import sglang  # noqa: F401  (a missing SGLang fails here, loudly)

from refitflow.integrations.hosting.info import RefitflowInitInfo, RefitflowUpdateInfo
from refitflow.integrations.sglang.driver import SglangFleet
from refitflow.integrations.sglang.payload import LOADER, encode
from tests.conftest import free_ports
from tests.integrations._tiny import config
from tests.integrations._trainer import ROOT, Trainer
from tests.transports._nixl_peer import LineChild


def plugin_metadata(at: pathlib.Path) -> str:
    """The package metadata ``pip install`` writes from pyproject.toml's ``sglang.srt.plugins`` entry point
    (written here, so the test does not depend on how this checkout was installed)."""
    declared = tomllib.loads((pathlib.Path(ROOT) / "pyproject.toml").read_text())["project"]["entry-points"]
    dist = at / "refitflow-0.1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: refitflow\nVersion: 0.1.0\n")
    lines = [f"{name} = {target}\n" for name, target in declared["sglang.srt.plugins"].items()]
    (dist / "entry_points.txt").write_text("[sglang.srt.plugins]\n" + "".join(lines))
    return str(at)


class Server(LineChild):
    def __init__(self, tmp: pathlib.Path, tp: int = 2, env: dict[str, str] | None = None) -> None:
        cfg = config("qwen2")
        cfg.architectures = ["Qwen2ForCausalLM"]  # SGLang's ServerArgs reads the model's config from its path
        cfg.save_pretrained(tmp / "model")
        spec = json.dumps({"tp": tp, "config": str(tmp / "model"), "plugins": plugin_metadata(tmp / "plugins")})
        super().__init__([sys.executable, "-m", "tests.integrations._sglang_server", spec], path=[ROOT], env=env)

    async def __aenter__(self) -> Self:
        await super().__aenter__()
        self.url = str((await self._ask(None))["url"])
        self.http = httpx.AsyncClient(base_url=self.url, timeout=120)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.http.aclose()
        await super().__aexit__(*exc)

    async def state(self, seed: int | None = None) -> list[dict[str, Any]]:
        params = {} if seed is None else {"seed": seed}
        return list((await self.http.get("/test/state", params=params)).json())

    async def post(self, route: str, body: dict[str, Any] | None = None) -> tuple[int, dict[str, Any]]:
        response = await self.http.post(route, json=body if body is not None else {})
        return response.status_code, response.json()


def init_info(registry: str, **extra: Any) -> RefitflowInitInfo:
    fields: dict[str, Any] = {"identity": {"layout": "megatron"}, "budget_bytes": 1 << 16, "vote_timeout_s": 20,
                              "vote_addresses": [f"tcp://127.0.0.1:{p}" for p in free_ports(2)]}  # fmt: skip
    return RefitflowInitInfo(registry=registry, model="tiny-vllm", **fields | extra)


def update_body(init: RefitflowInitInfo, version: int) -> dict[str, Any]:
    return {"serialized_named_tensors": encode(init, RefitflowUpdateInfo(version=version, timeout_s=60), tp=2),
            "load_format": LOADER, "weight_version": str(version)}  # fmt: skip


@pytest.mark.asyncio
async def test_begin_update_end_over_sglangs_http_refits_both_ranks_and_a_failure_is_success_false(
    tmp_path: pathlib.Path,
) -> None:
    """Raw HTTP, SGLang's routes: pause → begin → update_weights_from_tensor (refitflow's loader) → end →
    continue; a corrupted slice on TP rank 0 is ``{"success": false}`` naming the IntegrityError on both
    ranks' behalf (rank 1 voted ready and learned ABORT): in place, both fenced, neither committed; SGLang's
    session still closes, the server refuses requests and resuming until the next version commits; a rank in
    doubt is reported, whichever rank it is (SGLang returns rank 0's answer alone), and resolved."""
    with anyio.fail_after(400):
        async with Trainer("qwen2") as trainer, Server(tmp_path) as server:
            init = init_info(trainer.registry)
            await trainer.publish(1, seed=1)
            assert (await server.post("/pause_generation", {"mode": "retract"}))[0] == 200
            assert await server.post("/begin_weight_update") == (200, {"success": True, "message": "Success"})
            status, answer = await server.post("/update_weights_from_tensor", update_body(init, 1))
            assert status == 200 and answer["success"], answer
            assert await server.post("/end_weight_update") == (200, {"success": True, "message": "Success"})
            assert (await server.post("/continue_generation"))[0] == 200
            for rank in await server.state(seed=1):
                assert rank["holds"] and rank["pointers_kept"], rank
                assert rank["committed_version"] == 1 and rank["fence"] == "ready" and rank["versions"] == ["1"]
                assert rank["loader"] == "direct"
            assert (await server.http.get("/test/weight_version")).json()["weight_version"] == "1"

            status, answer = await server.post("/update_weights_from_tensor", update_body(init, 1))
            assert status == 400 and not answer["success"] and "begin_weight_update" in answer["message"]

            await trainer.publish(2, seed=2, corrupt=0)  # a byte of TP rank 0's slice
            assert (await server.post("/begin_weight_update"))[0] == 200
            status, answer = await server.post("/update_weights_from_tensor", update_body(init, 2))
            assert status == 400 and answer["success"] is False, answer
            assert answer["message"].startswith("refitflow: IntegrityError"), answer
            assert "rank 1: RefitError" in answer["message"] and "must not serve" in answer["message"], answer
            assert (await server.post("/end_weight_update"))[0] == 200  # SGLang's session closes all the same
            for rank in await server.state(seed=1):  # in place: written, fenced, and version 1 no longer
                assert rank["committed_version"] == 1 and rank["fence"] == "fenced" and rank["versions"] == ["1"]
                assert rank["holds"] is False, rank
            refused = await server.http.post("/generate", json={"input_ids": [1, 2, 3]})  # the gate: no request
            assert refused.status_code == 400 and "must not serve" in refused.text, refused.text
            assert (await server.http.post("/continue_generation", json={})).status_code != 200  # nor resuming

            await trainer.publish(3, seed=3)
            assert (await server.post("/begin_weight_update"))[0] == 200
            assert (await server.post("/update_weights_from_tensor", update_body(init, 3)))[1]["success"]
            assert (await server.post("/end_weight_update"))[0] == 200
            for rank in await server.state(seed=3):
                assert rank["holds"] and rank["committed_version"] == 3 and rank["fence"] == "ready", rank
            assert (await server.post("/continue_generation"))[0] == 200  # every rank serves version 3: open

            # rank 1 (whose answer SGLang drops) loses its verdict while rank 0 commits: the answer says so
            await server.http.post("/test/lose_verdict", params={"rank": 1})
            await trainer.publish(4, seed=4)
            assert (await server.post("/begin_weight_update"))[0] == 200
            status, answer = await server.post("/update_weights_from_tensor", update_body(init, 4))
            assert status == 400 and answer["success"] is False, answer
            assert "rank 1: RefitError: in doubt" in answer["message"] and "must not serve" in answer["message"]
            assert (await server.post("/end_weight_update"))[0] == 200
            assert (await server.http.post("/generate", json={"input_ids": [1, 2, 3]})).status_code == 400

            # rank 0 (whose answer SGLang returns) loses the next verdict: the driver sees the doubt, keeps the
            # server paused; rank 1 committed version 5. The next refit resolves both doubts: version 6 everywhere.
            await server.http.post("/test/lose_verdict", params={"rank": 0})
            fleet = SglangFleet({"a": server.url}, init, tp=2)
            await trainer.publish(5, seed=5)
            result = (await fleet.refit(5, timeout_s=60))["a"]
            assert not result.committed and "in doubt" in (result.ranks[0].error or ""), result
            assert fleet.paused == {"a"} and (await server.http.get("/test/weight_version")).json()["paused"]
            zero, one = await server.state(seed=5)
            assert zero["in_doubt"] is not None and zero["fence"] == "updating" and zero["committed_version"] == 4
            assert one["holds"] and one["committed_version"] == 5
            await trainer.publish(6, seed=6)
            result = (await fleet.refit(6, timeout_s=60))["a"]
            assert result.committed and result.version == 6 and not fleet.paused, result
            for rank in await server.state(seed=6):
                assert rank["holds"] and rank["committed_version"] == 6 and rank["in_doubt"] is None, rank
            assert not (await server.http.get("/test/weight_version")).json()["paused"]


@pytest.mark.asyncio
async def test_the_fleet_driver_keeps_a_failed_shadow_server_serving_the_previous_version(
    tmp_path: pathlib.Path,
) -> None:
    """``SglangFleet`` in shadow mode, the vote's addresses exchanged over SGLang's gloo world group: a
    version corrupted on TP rank 1's slice is a failed engine (SGLang answers with rank 0's result, which
    names the rank that was not ready), the server is continued and still holds version 1 bit-exactly;
    the next version commits; new init info reopens each rank's session, and the version after commits."""
    with anyio.fail_after(400):
        async with Trainer("qwen2") as trainer, Server(tmp_path) as server:
            init = init_info(trainer.registry, mode="shadow", vote_addresses=None)
            fleet = SglangFleet({"a": server.url}, init, tp=2)
            await trainer.publish(1, seed=1)
            result = (await fleet.refit(1, timeout_s=60))["a"]
            assert result.committed and result.version == 1, result
            await trainer.publish(2, seed=2, corrupt=1)
            result = (await fleet.refit(2, timeout_s=60))["a"]
            assert not result.committed and "update_weights_from_tensor: 400" in (result.ranks[0].error or "")
            # SGLang answers with TP rank 0's result, which now carries every rank's: rank 1's slice was corrupted
            error = result.ranks[0].error or ""
            assert "ranks [1] not ready" in error and "rank 1: IntegrityError" in error and not fleet.paused
            assert not (await server.http.get("/test/weight_version")).json()["paused"]
            for rank in await server.state(seed=1):
                assert rank["holds"] and rank["fence"] == "ready" and rank["committed_version"] == 1, rank
            await trainer.publish(3, seed=3)
            result = (await fleet.refit(3, timeout_s=60))["a"]
            assert result.committed and result.version == 3, result
            for rank in await server.state(seed=3):
                assert rank["holds"] and rank["pointers_kept"], rank

            # new init info (a smaller staging budget): each rank closes its session and opens a new one
            fleet = SglangFleet({"a": server.url}, init_info(trainer.registry, mode="shadow", vote_addresses=None,
                                                             budget_bytes=1 << 15), tp=2)  # fmt: skip
            await trainer.publish(4, seed=4)
            result = (await fleet.refit(4, timeout_s=60))["a"]
            assert result.committed and result.version == 4, result
            for rank in await server.state(seed=4):
                assert rank["holds"] and rank["pointers_kept"] and rank["committed_version"] == 4, rank


@pytest.mark.asyncio
async def test_a_server_that_joins_refuses_requests_until_the_fleet_refit_it_from_a_peer(
    tmp_path: pathlib.Path,
) -> None:
    """A server started with ``REFITFLOW_JOIN=1`` while the fleet is at version 1 refuses every request and its
    readiness route says catching up; ``SglangFleet.add`` refits it to version 1 — read from the peer that holds
    it (``serve_replicas``) wherever the peer holds a piece in one strided read — and takes it in once current;
    then the two refit together."""
    with anyio.fail_after(400):
        async with (
            Trainer("qwen2") as trainer,
            Server(tmp_path / "a", tp=1) as a,
            Server(tmp_path / "b", tp=1, env={"REFITFLOW_JOIN": "1"}) as b,
        ):
            init = init_info(trainer.registry, vote_addresses=None, receiver_options={"serve_replicas": True})
            await trainer.publish(1, seed=1)
            fleet = SglangFleet({"a": a.url}, init, tp=1)
            assert (await fleet.refit(1, timeout_s=60))["a"].committed and fleet.version == 1

            refused = await b.http.post("/generate", json={"input_ids": [1, 2, 3]})
            assert refused.status_code == 400 and "catching up" in refused.text, refused.text
            ready = await b.http.get("/refitflow/ready")
            assert ready.status_code == 503 and ready.json()["state"] == "catching_up", ready.text
            assert (await a.http.get("/refitflow/ready")).json() | {"reason": None} == {
                "engine": "this server",
                "state": "current",
                "version": 1,
                "reason": None,
                "ready": True,
            }

            state = await fleet.add("b", b.url, timeout_s=120)
            assert state.ready and state.version == 1, state
            (rank,) = await b.state(seed=1)
            assert rank["holds"] and rank["committed_version"] == 1, rank
            # from its peer: everything a relay can serve in one strided read (the trainer only for the pieces its
            # peer holds in another geometry); no peer read failed
            assert rank["relay_bytes"] > rank["pulled_bytes"] // 2 and rank["rerouted_bytes"] == 0, rank
            refused = await b.http.post("/generate", json={"input_ids": [1, 2, 3]})
            assert "catching up" not in refused.text, refused.text

            await trainer.publish(2, seed=2)
            assert all(r.committed and r.version == 2 for r in (await fleet.refit(2, timeout_s=60)).values())
            states = await fleet.states()
            assert {n: (s.state, s.version) for n, s in states.items()} == {"a": ("current", 2), "b": ("current", 2)}
