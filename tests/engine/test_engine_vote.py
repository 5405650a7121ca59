"""Engine-wide atomic commit over a real vote channel (gloo group or ZMQ) of three rank processes."""

from __future__ import annotations

import multiprocessing as mp
from typing import Any

import pytest

from refitflow.engine.commitment import Register
from refitflow.engine.vote import Ballot, Decision, decide
from tests.conftest import free_ports
from tests.engine.engine_worker import run_rank

KINDS = pytest.mark.parametrize("kind", ["gloo", "zmq"])


def run_engine(scenario: str, mode: str, kind: str) -> dict[int, dict[str, Any]]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    ports = free_ports(3)
    procs = [ctx.Process(target=run_rank, args=(r, ports, scenario, mode, kind, queue)) for r in range(3)]
    for p in procs:
        p.start()
    expected = 2 if scenario == "killed" else 3
    results = dict(queue.get(timeout=90) for _ in range(expected))
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode is not None, "a rank hung"
    return results


def test_decide_rule() -> None:
    ready = Ballot(True, True, 7)
    assert decide([ready, ready]) is Decision.COMMIT
    assert decide([ready, Ballot(True, True, 8)]) is Decision.ABORT
    assert decide([ready, Ballot(False, True, 7)]) is Decision.ABORT
    assert decide([ready, None]) is Decision.ABORT
    assert decide([Ballot(False, False, -1), Ballot(False, False, -1)]) is Decision.NOTHING
    assert decide([ready, Ballot(False, False, -1)]) is Decision.ABORT


def test_an_abort_written_before_every_ballot_came_names_the_rank_not_ready_and_no_deadline() -> None:
    """Rank 1 fails fast: the register aborts on its ballot without waiting for rank 0's, and says so."""
    register = Register(2)
    assert register.own(1, Ballot(True, True, 7), 0) is None  # the coordinator votes in attempt 1 ...
    early = register.post(2, 1, Ballot(False, True, 8))  # ... and rank 1 is not ready in attempt 2 first
    assert early is not None and early.decision is Decision.ABORT
    assert early.reason == "ranks [1] not ready; decided without waiting for ranks [0]", early.reason
    late = register.expire(1, "deadline")  # attempt 1 still lacks rank 1's ballot at the deadline: that one was lost
    assert late is not None and "no ballot of ranks [1] had been read by the coordinator by its deadline" in late.reason


@KINDS
def test_clean_attempt_commits_on_every_rank(kind: str) -> None:
    results = run_engine("clean", "in_place", kind)
    assert all(r.get("committed") and r["serves_new"] and r["fence"] == "ready" for r in results.values()), results


@KINDS
def test_one_rank_failing_a_bucket_aborts_all_in_place_ranks_fenced(kind: str) -> None:
    results = run_engine("fail", "in_place", kind)
    assert all(not r.get("committed") and r["decision"] == "abort" for r in results.values()), results
    assert all(r["fence"] == "fenced" for r in results.values()), results


@KINDS
def test_one_rank_refusing_begin_aborts_the_others_and_is_fenced_too(kind: str) -> None:
    results = run_engine("refuse", "shadow", kind)
    assert all(not r.get("committed") and r["decision"] == "abort" for r in results.values()), results
    assert "ranks [2] not ready" in results[2]["reason"] and results[2]["fence"] == "fenced"
    for rank in (0, 1):  # shadow: the old version keeps serving
        assert results[rank]["fence"] == "ready" and results[rank]["serves_old"], results


@KINDS
def test_a_rank_killed_mid_vote_means_no_rank_commits_and_none_hangs(kind: str) -> None:
    results = run_engine("killed", "shadow", kind)
    assert set(results) == {0, 1}
    for r in results.values():
        assert not r.get("committed") and r["decision"] == "abort" and r["serves_old"], results
