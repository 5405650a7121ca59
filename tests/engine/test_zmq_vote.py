"""ZmqVote in one process: one verdict for every rank, silent peers, late ballots, explicit attempt ids."""

from __future__ import annotations

import anyio
import pytest
import zmq

from refitflow.core.errors import ConfigError
from refitflow.engine.vote import Ballot, Decision, Verdict
from refitflow.engine.zmq_vote import ZmqVote
from tests._procs import ends_within
from tests.conftest import free_addresses


async def _vote(channels: list[ZmqVote], ballots: dict[int, Ballot], timeout: float) -> dict[int, Verdict]:
    got: dict[int, Verdict] = {}

    async def one(ch: ZmqVote) -> None:
        got[ch.rank] = await ch.vote(ballots[ch.rank], timeout)

    async with anyio.create_task_group() as tg:
        for ch in channels:
            if ch.rank in ballots:
                tg.start_soon(one, ch)
    return got


@pytest.mark.asyncio
async def test_every_rank_learns_the_one_verdict_and_a_silent_peer_aborts_the_attempt() -> None:
    addrs = free_addresses(3)
    channels = [ZmqVote(r, addrs, settle_s=2) for r in range(3)]
    try:
        with anyio.fail_after(30):
            got = await _vote(channels, {r: Ballot(True, True, 4) for r in range(3)}, 5)
            assert {(v.decision, v.version) for v in got.values()} == {(Decision.COMMIT, 4)}
            got = await _vote(channels, {0: Ballot(True, True, 5), 1: Ballot(True, True, 5)}, 0.5)  # 2 silent
            assert {v.decision for v in got.values()} == {Decision.ABORT}
            assert "no ballot of ranks [2] had been read" in got[0].reason
            late = await channels[2].vote(Ballot(True, True, 5), 5)  # rank 2 votes late: the verdict stands
            assert late.decision is Decision.ABORT and late.attempt == got[0].attempt
    finally:
        for ch in channels:
            ch.close()


@pytest.mark.asyncio
async def test_a_ballot_for_a_later_attempt_waits_for_it_and_an_earlier_one_never_commits() -> None:
    addrs = free_addresses(2)
    a, b = ZmqVote(0, addrs), ZmqVote(1, addrs)
    try:
        with anyio.fail_after(30):
            a.set_attempt(7)
            assert (await a.vote(Ballot(True, True, 1), 0.3)).decision is Decision.ABORT  # rank 1 not there yet
            b.set_attempt(7)  # rank 1 votes in attempt 7 after the coordinator closed it
            assert (await b.vote(Ballot(True, True, 1), 5)).decision is Decision.ABORT
            b.set_attempt(9)  # a peer ahead: its ballot waits for the coordinator's attempt 9
            async with anyio.create_task_group() as tg:
                tg.start_soon(b.vote, Ballot(True, True, 3), 10)
                await anyio.sleep(0.3)
                a.set_attempt(9)
                verdict = await a.vote(Ballot(True, True, 3), 10)
            assert (verdict.decision, verdict.version) == (Decision.COMMIT, 3)
            assert (await b.resolve(9, 1)).decision is Decision.COMMIT
            with pytest.raises(ConfigError):
                a.set_attempt(9)
    finally:
        a.close()
        b.close()


def test_each_rank_needs_its_own_address_and_curve_needs_both_sides() -> None:
    with pytest.raises(ConfigError):
        ZmqVote(0, ["tcp://127.0.0.1:1", "tcp://127.0.0.1:1"])
    with pytest.raises(ConfigError):
        ZmqVote(2, ["tcp://127.0.0.1:1", "tcp://127.0.0.1:2"])
    with pytest.raises(ConfigError, match="both"):
        ZmqVote(0, ["tcp://127.0.0.1:1", "tcp://127.0.0.1:2"], server_security=object())  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", ["own", "peer", "taken"])
def test_an_address_zmq_refuses_is_a_config_error_and_leaves_nothing_open(bad: str) -> None:
    """A socket left open would make the context's term() wait forever: the constructor runs in a thread
    of its own, so a hang fails the test instead of hanging it."""
    own, peer = free_addresses(2)
    squatter_ctx = zmq.Context()
    squatter = squatter_ctx.socket(zmq.PULL)
    squatter.bind(own)  # only "taken" builds the vote on this address
    addresses = {"own": ["tcp://no port", peer], "peer": [peer, "tcp://not a host:x"], "taken": [own, peer]}[bad]
    try:
        caught = ends_within(lambda: ZmqVote(0, addresses).close(), 10)
        assert isinstance(caught, ConfigError), caught
        assert "engine vote: cannot" in str(caught)
    finally:
        squatter_ctx.destroy(linger=0)
