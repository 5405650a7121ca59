"""The READs a ``NixlTransport`` has in flight, per peer: a peer is forgotten only once none of its READs is.

Once NIXL forgets a peer (``remove_remote_agent``, or the peer's metadata loaded again), a READ of it still on the
wire can no longer be checked — ``check_xfer_state`` answers ``NIXL_ERR_NOT_FOUND`` — yet UCX has not cancelled it
(``ucp_request_cancel`` does not cancel RMA, and NIXL closes endpoints without ``UCP_EP_CLOSE_FLAG_FORCE``): when
the peer answers again, after a network partition heals, its bytes still land, in memory a refit may have
given to other bytes meanwhile (``tests/transports/test_nixl_orphans.py`` shows it with NIXL itself). So:

- a peer is dropped (to connect afresh) only when none of its READs is in flight; until then the drop waits
  (``drop``), and a read of that peer waits for it (``idle``: the drop happens, then the read connects anew);
- a READ nobody waits for any longer (``abandon``: its deadline passed) stays checked by its poster until it
  ends — landed, or failed when UCX gives the connection up (``dead_peer_s`` into a partition over TCP) —
  and its memory is not reused before: ``quiesce`` waits for every abandoned READ to end.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable

import anyio

from refitflow.core.errors import TransportError

__all__ = ["Flights"]


class Flights:
    def __init__(self, remove: Callable[[str], None]) -> None:
        self._remove = remove  # forgets a peer in NIXL: only ever called with none of its READs in flight
        self._count: Counter[str] = Counter()  # peer -> its READs in flight
        self._dropping: set[str] = set()  # peers to forget once their READs end
        self._abandoned: dict[object, tuple[str, ...]] = {}  # a flight nobody waits for -> its peers
        self._waiters: list[anyio.Event] = []

    def began(self, peers: Iterable[str]) -> None:
        self._count.update(peers)

    def ended(self, peers: Iterable[str], flight: object = None) -> None:
        """READs of ``peers`` ended (``flight``: the read they were part of, once all of it ended)."""
        self._count.subtract(peers)
        if flight is not None:
            self._abandoned.pop(flight, None)
        for peer in [p for p in self._dropping if self._count[p] <= 0]:
            self._dropping.discard(peer)
            self._remove(peer)
        for event in self._waiters:
            event.set()
        self._waiters.clear()

    def drop(self, peer: str) -> None:
        """Forget ``peer`` now if none of its READs is in flight, else once the last of them ended."""
        if self._count[peer] > 0:
            self._dropping.add(peer)
        else:
            self._remove(peer)

    def abandon(self, flight: object, pending: Iterable[str]) -> None:
        """Nobody waits for ``flight`` any longer while READs of ``pending`` peers are in progress: they stay
        checked until they end, and their peers are dropped then (after a partition heals, UCX's endpoint to a
        live peer may be dead: the next read connects afresh)."""
        peers = tuple(sorted(set(pending)))
        if peers:
            self._abandoned[flight] = peers
        for peer in peers:
            self.drop(peer)

    def abandoned(self) -> list[object]:
        """The abandoned flights still in progress."""
        return list(self._abandoned)

    def busy(self, peer: str) -> bool:
        """Whether ``peer`` has READs in flight or a drop waiting for them."""
        return self._count[peer] > 0 or peer in self._dropping

    def dropping(self, peer: str | None = None) -> bool:
        """Whether ``peer`` (None: any peer) waits to be dropped."""
        return bool(self._dropping) if peer is None else peer in self._dropping

    async def idle(self, peer: str, within: float) -> None:
        """Wait until ``peer`` has no READ in flight (and a drop waiting for that happened); ``TransportError``
        after ``within`` seconds."""
        if self.busy(peer):
            await self._until(lambda: not self.busy(peer), within)
        if self.busy(peer):
            raise TransportError(f"READs of {peer!r} still in flight after {within} s: its connection cannot be "
                                 f"replaced before they end")  # fmt: skip

    async def quiesce(self, within: float) -> None:
        """Wait until every abandoned READ has ended; ``TransportError`` after ``within`` seconds."""
        if self._abandoned:
            await self._until(lambda: not self._abandoned, within)
        if self._abandoned:
            peers = sorted({p for ps in self._abandoned.values() for p in ps})
            raise TransportError(f"{len(self._abandoned)} abandoned read(s) of {peers} still in progress after "
                                 f"{within} s: the memory they land in is not reused before they end")  # fmt: skip

    async def _until(self, done: Callable[[], bool], within: float) -> None:
        with anyio.move_on_after(within):
            while not done():
                event = anyio.Event()
                self._waiters.append(event)
                await event.wait()
