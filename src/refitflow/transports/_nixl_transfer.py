"""Posting prepared READs and waiting for them to end, for ``NixlTransport``: ``read`` and ``submit``.

``transfer`` (``read``): one worker thread per agent posts that agent's READs one after the other (one thread
hop for all of a bucket's peers: a bucket of a TP-sharded trainer reads from each trainer rank) and checks those
in progress briefly (``LockedAgent.post``); any still pending is polled from the event loop with growing sleeps
(no spinning). ``Posted`` (``submit``): each agent's ``Poster`` thread posts the batch and says when it ended;
the loop is not waiting meanwhile. Either way a peer whose READ fails does not keep the others from being posted
and waited for.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import anyio
import anyio.to_thread

from refitflow.core.errors import TransportError
from refitflow.core.threads import waker
from refitflow.transports._nixl_poster import Poster, State
from refitflow.transports._nixl_prepared import ended, submitted
from refitflow.transports._nixl_state import _Prepared
from refitflow.transports.base import Read, Submitted, Transport

__all__ = ["Posted", "transfer"]


async def transfer(batch: list[tuple[_Prepared, str]], count: bool, drop_peer: Callable[[str], None]) -> None:
    """Post every READ of ``batch`` ((prepared, peer) pairs), with its served-bytes notification when
    ``count``, and wait until each has ended; ``drop_peer`` a peer found disconnected, or one with a READ still
    in progress when the wait is cancelled (a read deadline: after a partition heals, its UCX endpoint may be
    dead, and the next read must connect afresh). Raises the first failure, once every READ posted has ended."""
    per_agent: dict[int, list[tuple[_Prepared, str]]] = {}
    for p, peer in batch:
        per_agent.setdefault(id(p.nx), []).append((p, peer))
    failures: list[TransportError] = []

    async def agent_reads(group: list[tuple[_Prepared, str]]) -> None:
        nx = group[0][0].nx
        posts = [(p.handles[2], p.notif if count else b"") for p, _ in group]
        states = await anyio.to_thread.run_sync(nx.post, posts)
        for (p, peer), state in zip(group, states, strict=True):
            try:
                delay = 1e-3
                while state == "PROC":
                    await anyio.sleep(delay)
                    delay = min(delay * 2, 0.002)
                    state = nx.try_state(p.handles[2]) or "PROC"
                if isinstance(state, TransportError):
                    raise state
                if state != "DONE":
                    raise TransportError(f"nixl READ from {peer!r} ended in state {state}")
            except TransportError as exc:
                if isinstance(exc.__cause__, nx.disconnected):
                    drop_peer(peer)
                failures.append(exc)
            except BaseException:  # cancelled (a read deadline) with this READ still in progress
                stuck.update(peer for (_, peer), s in zip(group, states, strict=True) if s == "PROC")
                raise

    stuck: set[str] = set()
    groups = list(per_agent.values())
    try:
        if len(groups) == 1:
            await agent_reads(groups[0])
        else:
            async with anyio.create_task_group() as tg:
                for group in groups:
                    tg.start_soon(agent_reads, group)
    finally:
        for peer in stuck:  # a peer that stopped answering: its connection may be dead after the network heals
            drop_peer(peer)
    if failures:
        raise failures[0]


class Posted(Submitted):
    """A ``submit``ted read: every agent's part handed to its ``Poster``; ``wait`` returns once all ended.

    ``ended(failed)`` runs on the loop once every part ended (``failed``: whether any READ failed): the
    transport releases what it prepared for the read alone, or forgets what it cached for a failed one. A
    failure whose cause is a disconnected peer drops that peer (``drop_peer``) and, as ``read`` does, the reads
    are tried once more over a new connection (``transport.read``); so are they when any connection was dropped
    after they were submitted (``dropped()``: another read found a peer dead and dropped it under this one)."""

    def __init__(
        self, transport: Transport, reads: Sequence[Read], key: Hashable | None, count: bool,
        batch: list[tuple[_Prepared, str]], posters: dict[int, Poster], drop_peer: Callable[[str], None],
        ended: Callable[[bool], None], dropped: Callable[[], bool],
    ) -> None:  # fmt: skip
        super().__init__(transport, reads, key, count)
        self._done = False  # every part ended (``_part_ended``)
        self._event: anyio.Event | None = None  # made by a waiter that came before the end
        self._failures: list[TransportError] = []
        self._disconnected = False  # a failure's cause was a disconnected peer: worth reading again
        self._drop_peer, self._ended, self._dropped = drop_peer, ended, dropped
        per_agent: dict[int, list[tuple[_Prepared, str]]] = {}
        for p, peer in batch:
            per_agent.setdefault(id(p.nx), []).append((p, peer))
            submitted(p)
        self._pending: set[str] = {peer for _, peer in batch}  # peers with a READ not yet ended
        self._left = len(per_agent)
        if not per_agent:
            self._done = True
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
        for (p, peer), state in zip(group, states, strict=True):
            ended(p)
            self._pending.discard(peer)
            if isinstance(state, TransportError):
                if isinstance(state.__cause__, p.nx.disconnected):
                    self._drop_peer(peer)
                    self._disconnected = True
                self._failures.append(state)
            elif state != "DONE":
                self._failures.append(TransportError(f"nixl READ from {peer!r} ended in state {state}"))
        self._left -= 1
        if not self._left:
            self._ended(bool(self._failures))
            self._done = True
            if self._event is not None:
                self._event.set()

    def landed(self) -> bool:
        return self._done and not self._failures

    async def _end(self) -> None:
        if not self._done:
            if self._event is None:
                self._event = anyio.Event()
            await self._event.wait()

    async def wait(self) -> None:
        await self._end()
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
        await self._end()

    def abandon(self) -> None:
        """Nobody waits any longer (a deadline passed while READs were in progress): the peers they read from are
        dropped — their READs then end with an error, and the next read connects afresh (after a partition
        heals, UCX's endpoint to a live peer may be dead), as ``transfer`` does for a read cancelled mid-way."""
        for peer in sorted(self._pending):
            self._drop_peer(peer)
