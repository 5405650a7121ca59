"""A rank stopped (SIGSTOP) mid-vote and resumed after every deadline: no two ranks decide differently.

Before, both channels split: ranks 0–1 committed at the deadline while rank 2 aborted, or ranks 0–1
aborted and rank 2 committed alone after its own deadline. Now every rank ends with the same
decision and serves the same version (or none, fenced); a rank that could not learn the verdict
while a peer was stopped stays in doubt (``updating``) until the stopped peer resumes and answers.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest

from tests.conftest import free_ports
from tests.faults._stall_rank import run_rank


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def _run(kind: str, stall: tuple[int, str]) -> tuple[dict[int, dict], dict[int, dict]]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    ports = free_ports(3)
    procs = [ctx.Process(target=run_rank, args=(r, ports, kind, stall, queue)) for r in range(3)]
    for p in procs:
        p.start()
    stopped = procs[stall[0]]
    first: dict[int, dict] = {}
    final: dict[int, dict] = {}
    try:
        deadline = time.monotonic() + 90
        while not _stopped(stopped.pid):  # the rank stops itself at its step of the vote
            assert time.monotonic() < deadline and stopped.exitcode is None, "the rank never reached its stall"
            time.sleep(0.05)
        while len(first) < 2:  # the others finish their vote (decided, or in doubt) while it is stopped
            rank, what, state = queue.get(timeout=60)
            (first if what == "first" else final)[rank] = state
        time.sleep(1.0)  # well past every deadline
        os.kill(stopped.pid, signal.SIGCONT)
        while len(final) < 3:
            rank, what, state = queue.get(timeout=60)
            (first if what == "first" else final)[rank] = state
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.exitcode is None:
                os.kill(p.pid, signal.SIGCONT)
                p.kill()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return first, final


STALLS = [(0, "after"), (2, "before"), (2, "after")]


@pytest.mark.parametrize("kind", ["zmq", "gloo"])
@pytest.mark.parametrize("stall", STALLS, ids=[f"rank{r}-{s}" for r, s in STALLS])
def test_a_rank_stopped_mid_vote_never_splits_the_engine(kind: str, stall: tuple[int, str]) -> None:
    first, final = _run(kind, stall)
    assert all("error" not in s for s in final.values()), final
    decisions = {s["decision"] for s in final.values()}
    assert len(decisions) == 1 and decisions <= {"commit", "abort"}, (first, final)
    if decisions == {"commit"}:
        assert all(s["serves_new"] and s["fence"] == "ready" and s["committed_version"] == 1 for s in final.values())
    else:  # in place, every rank wrote before the vote: all fenced, none serves version 1
        assert all(s["fence"] == "fenced" and s["committed_version"] is None for s in final.values()), final
    for rank, s in first.items():  # while a peer was stopped: decided alike, or in doubt and not serving
        assert s["decision"] in (*decisions, "in_doubt"), (first, final)
        if s["decision"] == "in_doubt":
            assert s["fence"] == "updating" and not s["serves_old"], (rank, s)
    if stall == (2, "before"):  # a ballot that never came: the coordinator's deadline aborted
        assert decisions == {"abort"}
