"""The controller drives two engines of two rank processes each (ZMQ vote, loopback transport)."""

from __future__ import annotations

import multiprocessing as mp
import tempfile
from typing import Any

import anyio
import pytest

import refitflow as rf
from tests._procs import reap
from tests.engine._engine_rank import serve_rank


def _start(behaviours: dict[str, list[str]], where: str) -> tuple[dict[str, list[str]], list[Any]]:
    """Every rank in its own process; its vote and agent on ipc:// endpoints in ``where`` (a TCP port
    picked free here could be taken before a spawned rank binds it — an outgoing connection's ephemeral
    port, once: the agent failed to bind)."""
    ctx = mp.get_context("spawn")
    engines, procs = {}, []
    for name, ranks in behaviours.items():
        votes = [f"ipc://{where}/{name}-vote{r}" for r in range(len(ranks))]
        agents = [f"ipc://{where}/{name}-agent{r}" for r in range(len(ranks))]
        engines[name] = agents
        for rank, behaviour in enumerate(ranks):
            procs.append(ctx.Process(target=serve_rank, args=(rank, votes, agents[rank], behaviour)))
    for p in procs:
        p.start()
    return engines, procs


async def _run(behaviours: dict[str, list[str]]) -> tuple[dict[str, rf.EngineResult], dict[str, list]]:
    (results,), status = await _run_at_once(behaviours, 1)
    return results, status


async def _ready(controller: rf.Controller) -> None:
    """Wait until every rank's agent answers (spawned ranks import torch first: seconds on a busy
    machine), so that the refit's deadline measures the refit, never a rank still starting."""
    while True:
        if all(s is not None for ranks in (await controller.status(timeout=2)).values() for s in ranks):
            return
        await anyio.sleep(0.2)


async def _run_at_once(behaviours: dict[str, list[str]], refits: int) -> tuple[list[dict[str, rf.EngineResult]], dict]:
    """``refits`` refits of version 1 by one controller, started at once; their results, then every status."""
    results: list[dict[str, rf.EngineResult]] = []
    with tempfile.TemporaryDirectory(prefix="rf-ctl-") as where:
        engines, procs = _start(behaviours, where)
        controller = rf.Controller(engines, slack_s=5)

        async def refit() -> None:
            results.append(await controller.refit(1, timeout=10))

        try:
            with anyio.fail_after(120):
                await _ready(controller)
                async with anyio.create_task_group() as tg:
                    for _ in range(refits):
                        tg.start_soon(refit)
                status = await controller.status()
                await controller.stop_agents()
        finally:
            hung = reap(procs)
    assert not hung, f"ranks {hung} hung (their stacks are in the captured stderr)"
    return results, status


@pytest.mark.asyncio
async def test_every_engine_commits_on_every_rank() -> None:
    results, status = await _run({"a": ["clean", "clean"], "b": ["clean", "clean"]})
    assert all(r.committed and r.version == 1 for r in results.values()), results
    assert all(s["committed_version"] == 1 for ranks in status.values() for s in ranks), status


@pytest.mark.asyncio
async def test_a_failing_rank_fails_only_its_engine_and_nothing_commits_there() -> None:
    results, status = await _run({"a": ["clean", "fail"], "b": ["clean", "clean"]})
    assert results["b"].committed and not results["a"].committed, results
    assert all(not r.committed and r.decision == "abort" for r in results["a"].ranks), results["a"]
    assert all(s["committed_version"] is None and s["fence"] == "ready" for s in status["a"]), status  # shadow


@pytest.mark.asyncio
async def test_a_coordinator_that_dies_mid_refit_fails_its_engine_and_leaves_its_peer_in_doubt() -> None:
    results, status = await _run({"a": ["die", "clean"], "b": ["clean", "clean"]})
    assert results["b"].committed and not results["a"].committed, results
    dead, alive = results["a"].ranks
    # the coordinator (rank 0) died: the live rank voted ready and cannot learn a verdict, so it stays
    # in doubt — its version prepared, unseen, its fence closed — rather than guess
    assert "no answer" in (dead.error or "") and not alive.committed and alive.decision == "in_doubt", results["a"]
    assert status["a"][0] is None and status["a"][1]["committed_version"] is None, status
    assert status["a"][1]["fence"] == "updating" and status["a"][1]["in_doubt"] is not None, status


@pytest.mark.asyncio
async def test_a_participant_that_dies_mid_refit_aborts_its_engine_at_the_coordinators_deadline() -> None:
    results, status = await _run({"a": ["clean", "die"]})
    alive, dead = results["a"].ranks
    assert "no answer" in (dead.error or "") and not alive.committed and alive.decision == "abort", results["a"]
    assert status["a"][0]["fence"] == "ready" and status["a"][0]["committed_version"] is None, status  # shadow


@pytest.mark.asyncio
async def test_two_refits_of_one_controller_at_once_both_see_the_engine_commit() -> None:
    """Each rank runs one command at a time and answers another 'busy'. Two refits sent at once could
    reach the two ranks in opposite orders: each rank would run a different attempt, neither vote would
    gather both ballots, and the version would commit nowhere. A controller runs its refits one at a
    time, so the second finds the version committed."""
    got, status = await _run_at_once({"a": ["clean", "clean"]}, 3)
    assert len(got) == 3 and all(r["a"].committed and r["a"].version == 1 for r in got), got
    assert all(s["committed_version"] == 1 for s in status["a"]), status
