"""The peers a ``NixlTransport`` reads from: their addresses, NIXL's connections to them, their READs in flight.

A peer is *known* from its address (``connect``: its regions and NIXL metadata; a new address drops what was
prepared against the old one) and *loaded* into every agent on its first read (``ready``). A connection is
dropped — to connect afresh: after a partition heals, UCX's endpoint to a live peer may be dead — only once none
of the peer's READs is in flight (``Flights``), and a read of that peer waits for it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable

import anyio
import anyio.to_thread

from refitflow.core.errors import TransportError
from refitflow.core.types import SourceAddress
from refitflow.transports._nixl_agent import LockedAgent
from refitflow.transports._nixl_descs import RegionInfo, unpack_address
from refitflow.transports._nixl_flights import Flights
from refitflow.transports._nixl_state import CacheKey, _Peer

__all__ = ["Peers"]

_EPOCHS = itertools.count(1)
CONNECT_TRIES = 4  # add_remote_agent attempts when UCX cannot connect (0.1 + 0.2 + 0.4 s between them)
IDLE_WAIT_S = 30.0  # a peer's connection is replaced once its READs in flight ended: waited for this long


class Peers:
    def __init__(self, agents: list[LockedAgent], forget: Callable[[Callable[[CacheKey], bool]], None]) -> None:
        self._agents = agents
        self._forget = forget  # drops the transport's preparations whose cache key matches
        self.known: dict[str, _Peer] = {}
        self.drops = 0  # connections dropped so far: a read that fails after one may have failed for it
        self.flights = Flights(self.remove)  # READs in flight per peer (see ``_nixl_flights``)

    def connect(self, source: SourceAddress) -> None:
        peer = self.known.get(source.agent)
        if peer is not None and peer.address == source.metadata:
            return
        regions, md = unpack_address(source.metadata)
        self._forget(lambda k: k[1] == source.agent)  # prepared against the old snapshot
        self.known[source.agent] = _Peer(source.metadata, regions, next(_EPOCHS), md)

    def state(self) -> tuple[tuple[str, int], ...]:
        """Every peer's connection epoch: a description, a batch, made under another state is stale."""
        return tuple((a, p.epoch) for a, p in self.known.items())

    def regions(self) -> dict[str, dict[int, RegionInfo]]:
        return {agent: peer.regions for agent, peer in self.known.items()}

    def usable(self, agent: str) -> bool:
        """Whether every agent has ``agent`` loaded and no drop of it waits (a read may go at once)."""
        return self.known[agent].loaded and not self.flights.dropping(agent)

    async def ready(self, agent: str) -> None:
        """Make sure every agent has ``agent`` loaded (after a drop the drop happens first: what NIXL still
        checks of it ends before, ``IDLE_WAIT_S`` at most)."""
        if not self.usable(agent):
            await self.flights.idle(agent, IDLE_WAIT_S)
        if not self.known[agent].loaded:
            await self._load(agent)

    async def _load(self, agent: str) -> None:
        """Give NIXL the peer's metadata (a refresh if it knew an older snapshot): ~10 ms, so off the loop.

        A connection UCX cannot make (``NIXL_ERR_BACKEND``: "destination is unreachable" in the first moments
        after a network partition healed, or a refused connection to a process that died) is tried again,
        ``CONNECT_TRIES`` times in all over 0.7 s (the caller's read deadline bounds it); a peer NIXL knows to be
        gone (``NIXL_ERR_REMOTE_DISCONNECT``) is not."""
        peer = self.known[agent]
        for nx in self._agents:
            for attempt in range(CONNECT_TRIES):
                try:
                    name = await anyio.to_thread.run_sync(nx.call, "add_remote_agent", nx.agent.add_remote_agent,
                                                          peer.md)  # fmt: skip
                    break
                except TransportError as exc:
                    if attempt + 1 == CONNECT_TRIES or isinstance(exc.__cause__, nx.disconnected):
                        raise
                    await anyio.sleep(0.1 * 2**attempt)
            name = name.decode() if isinstance(name, bytes) else str(name)
            if name != agent:
                raise TransportError(f"address of {agent!r} carries the metadata of agent {name!r}")
        peer.loaded = True

    def reconnect(self, peers: Iterable[str]) -> None:
        for agent in peers:
            if agent in self.known:
                self.flights.drop(agent)

    def remove(self, agent: str) -> None:
        """Forget NIXL's connection to ``agent`` (its address stays): the next read connects afresh. Called only
        with none of its READs in flight (``Flights.drop``): NIXL could no longer check them, and UCX would still
        land them."""
        self.drops += 1
        self._forget(lambda k: k[1] == agent)
        peer = self.known.get(agent)
        for nx in self._agents if peer is not None and peer.loaded else []:
            try:
                nx.call("remove_remote_agent", nx.agent.remove_remote_agent, agent)
            except TransportError:
                pass  # already unusable
        if peer is not None:
            peer.loaded = False
