"""Posted READs, for ``NixlTransport`` (``submit``, and ``read``, which waits for what it submitted).

Each agent's ``Poster`` thread posts its part of the batch (one thread hop for all of a bucket's peers: a bucket
of a TP-sharded trainer reads from each trainer rank) and says when it ended; the loop is not waiting meanwhile.
A peer whose READ fails does not keep the others from being posted and waited for. Every READ is checked until
it ends, even once nobody waits for it (``abandon``): see ``_nixl_flights``.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import anyio

from refitflow.core.errors import TransportError
from refitflow.core.threads import waker
from refitflow.transports._nixl_flights import Flights
from refitflow.transports._nixl_poster import Poster, State
from refitflow.transports._nixl_prepared import ended, submitted
from refitflow.transports._nixl_state import _Prepared
from refitflow.transports.base import Read, Submitted, Transport

__all__ = ["Posted"]


class Posted(Submitted):
    """A ``submit``ted read: every agent's part handed to its ``Poster``; ``wait`` returns once all ended.

    ``ended(failed)`` runs on the loop once every part ended (``failed``: whether any READ failed): the
    transport releases what it prepared for the read alone, or forgets what it cached for a failed one. A
    failure whose cause is a disconnected peer drops that peer (``Flights.drop``) and, as ``read`` does, the
    reads are tried once more over a new connection (``transport.read``); so are they when any connection was
    dropped after they were submitted (``dropped()``: another read found a peer dead and dropped it)."""

    def __init__(
        self, transport: Transport, reads: Sequence[Read], key: Hashable | None, count: bool,
        batch: list[tuple[_Prepared, str]], posters: dict[int, Poster], flights: Flights,
        ended: Callable[[bool], None], dropped: Callable[[], bool],
    ) -> None:  # fmt: skip
        super().__init__(transport, reads, key, count)
        self._done = False  # every part ended (``_part_ended``)
        self._event: anyio.Event | None = None  # made by a waiter that came before the end
        self._failures: list[TransportError] = []
        self._disconnected = False  # a failure's cause was a disconnected peer: worth reading again
        self._flights, self._ended, self._dropped = flights, ended, dropped
        per_agent: dict[int, list[tuple[_Prepared, str]]] = {}
        for p, peer in batch:
            per_agent.setdefault(id(p.nx), []).append((p, peer))
            submitted(p)
        self._open = list(per_agent.values())  # the agents' parts not yet ended
        if not per_agent:
            self._done = True
        flights.began(peer for _, peer in batch)
        wake = waker()
        for agent, group in per_agent.items():
            posts = [(p.handles[2], p.notif if count else b"") for p, _ in group]
            posters[agent].submit(posts, self._on_loop(wake, group))

    def _on_loop(
        self, wake: Callable[[Callable[[], object]], object], group: list[tuple[_Prepared, str]]
    ) -> Callable[[list[State]], object]:
        """What the poster's thread calls when ``group`` ended: hand its states to the loop."""
        return lambda states: wake(lambda: self._part_ended(group, states))

    def _part_ended(self, group: list[tuple[_Prepared, str]], states: list[State]) -> None:
        self._open = [g for g in self._open if g is not group]  # by identity: preparations hold arrays
        self._flights.ended([peer for _, peer in group], None if self._open else self)
        for (p, peer), state in zip(group, states, strict=True):
            ended(p)
            if isinstance(state, TransportError):
                if isinstance(state.__cause__, p.nx.disconnected):
                    self._flights.drop(peer)
                    self._disconnected = True
                self._failures.append(state)
            elif state != "DONE":
                self._failures.append(TransportError(f"nixl READ from {peer!r} ended in state {state}"))
        if not self._open:
            self._ended(bool(self._failures))
            self._done = True
            if self._event is not None:
                self._event.set()

    def landed(self) -> bool:
        return self._done and not self._failures

    def failure(self) -> TransportError | None:
        """Once ended: the first failure, if any."""
        return self._failures[0] if self._failures else None

    async def wait(self) -> None:
        await self.settle()
        if not self._failures:
            return
        exc = self._failures[0]
        if not self._disconnected and not self._dropped():
            raise exc
        try:  # a peer that was disconnected: once more over a new connection, as ``read`` does
            await self.transport.read(self.reads, key=self.key, count=self.count)
        except TransportError as again:
            raise TransportError(f"{exc.reason}; reading again over a new connection failed too: "
                                 f"{again.reason}") from again  # fmt: skip

    async def settle(self) -> None:
        if not self._done:
            if self._event is None:
                self._event = anyio.Event()
            await self._event.wait()

    def abandon(self) -> None:
        """Nobody waits any longer (a deadline passed while READs were in progress): they stay checked until they
        end, their memory is not reused before (``NixlTransport.quiesce``), and their peers are dropped then."""
        if not self._done:
            self._flights.abandon(self, (peer for group in self._open for _, peer in group))
