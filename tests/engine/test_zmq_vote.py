"""ZmqVote in one process: every rank's ballot, silent peers, late ballots, explicit attempt ids."""

from __future__ import annotations

import socket

import anyio
import pytest

from refitflow.core.errors import ConfigError
from refitflow.engine.vote import Ballot
from refitflow.engine.zmq_vote import ZmqVote


def _addresses(n: int) -> list[str]:
    out = []
    for _ in range(n):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            out.append(f"tcp://127.0.0.1:{s.getsockname()[1]}")
    return out


async def _vote(channels: list[ZmqVote], ballots: dict[int, Ballot], timeout: float) -> dict[int, list]:
    got: dict[int, list] = {}

    async def one(ch: ZmqVote) -> None:
        got[ch.rank] = await ch.exchange(ballots[ch.rank], timeout)

    async with anyio.create_task_group() as tg:
        for ch in channels:
            if ch.rank in ballots:
                tg.start_soon(one, ch)
    return got


@pytest.mark.asyncio
async def test_every_rank_gets_every_ballot_and_a_silent_peer_is_none() -> None:
    addrs = _addresses(3)
    channels = [ZmqVote(r, addrs) for r in range(3)]
    try:
        with anyio.fail_after(20):
            votes = {r: Ballot(True, True, 4) for r in range(3)}
            got = await _vote(channels, votes, 5)
            assert all(got[r] == [votes[0]] * 3 for r in range(3))
            got = await _vote(channels, {0: votes[0], 1: Ballot(False, True, 5)}, 0.5)  # rank 2 silent
            assert got[0] == got[1] == [votes[0], Ballot(False, True, 5), None]
    finally:
        for ch in channels:
            ch.close()


@pytest.mark.asyncio
async def test_a_late_ballot_from_an_earlier_attempt_is_never_counted() -> None:
    addrs = _addresses(2)
    a, b = ZmqVote(0, addrs), ZmqVote(1, addrs)
    try:
        with anyio.fail_after(20):
            a.set_attempt(7)
            assert await a.exchange(Ballot(True, True, 1), 0.3) == [Ballot(True, True, 1), None]
            b.set_attempt(7)  # rank 1 votes in attempt 7 after rank 0 gave up on it
            await b.exchange(Ballot(True, True, 1), 0.3)
            a.set_attempt(8)
            assert await a.exchange(Ballot(True, True, 2), 0.5) == [Ballot(True, True, 2), None]
            b.set_attempt(9)  # a peer ahead: its ballot is kept for that attempt
            await b.exchange(Ballot(False, False, -1), 0.3)
            a.set_attempt(9)
            assert await a.exchange(Ballot(True, True, 3), 5) == [Ballot(True, True, 3), Ballot(False, False, -1)]
            with pytest.raises(ConfigError):
                a.set_attempt(9)
    finally:
        a.close()
        b.close()


def test_each_rank_needs_its_own_address() -> None:
    with pytest.raises(ConfigError):
        ZmqVote(0, ["tcp://127.0.0.1:1", "tcp://127.0.0.1:1"])
    with pytest.raises(ConfigError):
        ZmqVote(2, ["tcp://127.0.0.1:1", "tcp://127.0.0.1:2"])
