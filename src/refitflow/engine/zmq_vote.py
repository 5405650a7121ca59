"""The engine vote over refitflow's own ZMQ channel, for engines with no torch.distributed group.

Every rank binds one PULL socket on its own address and connects one PUSH socket to each peer's
(one per peer: a PUSH connected to several peers would round-robin). An exchange sends this rank's
ballot to every peer, tagged with the attempt id, then collects the peers' ballots for that
attempt until the deadline:

- a ballot for an earlier attempt (a peer that was late) is dropped, never counted;
- a ballot for a later attempt (a peer that is ahead) is kept for that attempt;
- a peer whose ballot has not arrived by the deadline is ``None`` (not ready, possibly begun).

Each message carries the sender's ballot and the ranks whose ballots it holds (its acks); a rank
says it again every ``resend_s`` and at once when it learns a new ballot. A rank returns when it
holds every ballot *and* every peer holds its own, or at the deadline: so a rank that returns and
exits never strands a peer without its ballot, and ranks that hold the same ballots decide alike
(a rank whose last ack was lost merely waits for the deadline, with all the ballots in hand).

Attempt ids count exchanges (every rank votes exactly once per attempt), or are set explicitly
with ``set_attempt`` by whoever drives the attempts (the controller's command id), which keeps
ranks in step even after one of them was restarted.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import zmq
import zmq.asyncio

from refitflow.core.errors import ConfigError
from refitflow.core.wire import decode, encode
from refitflow.engine.vote import Ballot

__all__ = ["ZmqVote"]

log = logging.getLogger(__name__)

_MAX_EARLY = 8  # later attempts whose ballots are kept


@dataclass
class _Attempt:
    ballots: dict[int, Ballot] = field(default_factory=dict)  # rank → its ballot
    acks: dict[int, set[int]] = field(default_factory=dict)  # peer → the ranks whose ballots it holds

    def settled(self, rank: int, size: int) -> bool:
        """Every ballot here, and every peer holds ours (so leaving now strands nobody)."""
        return len(self.ballots) == size and all(rank in self.acks.get(p, ()) for p in range(size) if p != rank)


class ZmqVote:
    """``VoteChannel`` over ZMQ: ``addresses[i]`` is rank ``i``'s ``tcp://host:port`` (or ``ipc://``)."""

    def __init__(self, rank: int, addresses: Sequence[str], *, group: str = "engine", resend_s: float = 0.1,
                 linger_s: float = 1.0) -> None:  # fmt: skip
        if not 0 <= rank < len(addresses):
            raise ConfigError(f"rank {rank} is not one of the {len(addresses)} addresses of the engine")
        if len(set(addresses)) != len(addresses):
            raise ConfigError(f"every rank of an engine needs its own vote address, got {list(addresses)}")
        self.rank, self.size, self.group = rank, len(addresses), group
        self.resend_s, self.linger_s = resend_s, linger_s
        self.addresses = list(addresses)
        self._context = zmq.asyncio.Context()
        self._pull = self._context.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.bind(addresses[rank])
        self._push: dict[int, zmq.asyncio.Socket] = {}
        for peer, address in enumerate(addresses):
            if peer != rank:
                sock = self._context.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(address)  # queued until the peer binds; never blocks the vote
                self._push[peer] = sock
        self._attempt = 0  # the last attempt this rank voted in
        self._next: int | None = None
        self._early: dict[int, _Attempt] = {}  # ballots from peers already in a later attempt
        self.closed = False

    @property
    def attempt(self) -> int:
        return self._attempt

    def set_attempt(self, attempt: int) -> None:
        """The id of the next exchange (must increase): a driver's command id keeps ranks in step."""
        if attempt <= self._attempt:
            raise ConfigError(f"vote attempt {attempt} does not increase (last was {self._attempt})")
        self._next = attempt

    async def exchange(self, ballot: Ballot, timeout: float) -> list[Ballot | None]:
        if self.closed:
            raise ConfigError("this vote channel is closed")
        attempt = self._next if self._next is not None else self._attempt + 1
        self._attempt, self._next = attempt, None
        state = self._early.pop(attempt, None) or _Attempt()
        state.ballots[self.rank] = ballot
        for stale in [a for a in self._early if a < attempt]:
            del self._early[stale]
        await self._broadcast(attempt, state)
        with anyio.move_on_after(timeout):
            while not state.settled(self.rank, self.size):
                with anyio.move_on_after(self.resend_s):
                    if self._take(await self._pull.recv(), attempt, state):
                        await self._broadcast(attempt, state)  # at once: a peer may wait for our ack
                    continue
                await self._broadcast(attempt, state)  # nothing new for a while: say it again
        return [state.ballots.get(r) for r in range(self.size)]

    async def _broadcast(self, attempt: int, state: _Attempt) -> None:
        mine = state.ballots[self.rank]
        message = encode({"g": self.group, "a": attempt, "r": self.rank, "b": [mine.ready, mine.began, mine.version],
                          "h": sorted(state.ballots)})  # fmt: skip
        for sock in self._push.values():
            try:
                await sock.send(message, flags=zmq.NOBLOCK)
            except zmq.Again:  # the peer's queue is full: it is not reading, so it will not count us
                pass

    def _take(self, data: bytes, attempt: int, state: _Attempt) -> bool:
        """File a peer's message; True when it brought a ballot this rank did not have."""
        try:
            m: Any = decode(data)
            peer, their, (ready, began, version) = int(m["r"]), int(m["a"]), m["b"]
            vote, has = Ballot(bool(ready), bool(began), int(version)), {int(r) for r in m["h"]}
            if m["g"] != self.group or not 0 <= peer < self.size or peer == self.rank:
                raise ValueError(f"ballot from group {m['g']!r} rank {peer}")
        except Exception as exc:  # a malformed or foreign ballot is never counted
            log.warning("engine vote: dropped a malformed ballot: %s", exc)
            return False
        if their < attempt:
            return False  # late, from an earlier attempt: never counted
        if their > attempt and their not in self._early and len(self._early) >= _MAX_EARLY:
            return False  # a peer far ahead (or a flood): it will resend when we get there
        target = state if their == attempt else self._early.setdefault(their, _Attempt())
        target.acks.setdefault(peer, set()).update(has)
        if peer in target.ballots:
            return False
        target.ballots[peer] = vote
        return their == attempt

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._pull.close(linger=0)
            for sock in self._push.values():  # a last ack still queued gets a moment to leave
                sock.close(linger=int(self.linger_s * 1000))
            self._context.term()

    async def __aenter__(self) -> ZmqVote:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()
