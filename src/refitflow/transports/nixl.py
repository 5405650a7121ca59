"""The NIXL transport: one-sided READs of peers' registered memory (UCX; cma between local processes).

``nixl`` is imported when a ``NixlTransport`` is created, never at package import. Each agent is
driven under its own lock (see ``_nixl_agent``); every NIXL failure becomes a
``TransportError``. Reads are described as vectorised Nx3 descriptor arrays, coalesced, and run
off the event loop. A read ``key`` (a cached plan's bucket) keeps its prepared descriptor lists
and transfer handle until its group (the plan) is forgotten (``_nixl_prepared``): a replay compares
the new descriptor arrays with the cached ones (cheap numpy equality) and only reposts the handle. A
peer whose metadata changed invalidates what was prepared against it; a local deregistration what lands
in that region (peers: ``_nixl_peers``). ``submit`` hands a read to each agent's poster thread (``_nixl_poster``)
and returns.

``num_agents > 1`` stripes each read across that many agents of this process, one thread each
(NIXL-NOTES: ≈1.7× one agent over cma; bench/nixl_bench.py here: 1.4×, 256 MiB, 2 shared cores);
peers only ever see the first agent, the only one with a progress thread. End to end with strict
verification it did not pay on 2 cores (``bench/nixl_ratio.py --agents 2``: raw READs faster, refits
not — hashing needs the second core), so the default stays one agent.

A peer that stops answering (its host unplugged, a network partition) fails its READs within ``dead_peer_s``
(5 s; over TCP: ``_nixl_agent.dead_peer_config``; None leaves it to UCX and its ``UCX_TCP_*`` variables) rather
than leaving them in progress: a READ on the wire cannot be cancelled, and the memory it lands in takes no other
bytes until it ended (``_nixl_flights``).

Registered tensors are referenced for as long as they are registered: NIXL over cma does not
enforce remote deregistration, so memory a peer may still read must not be freed and reused.
"""

from __future__ import annotations

import itertools
import logging
import time
import uuid
from collections.abc import Hashable, Iterable, Sequence
from typing import Any

import torch

from refitflow.core.errors import ConfigError, TransportError
from refitflow.core.threads import off_loop
from refitflow.core.types import SourceAddress
from refitflow.transports._nixl_agent import LockedAgent
from refitflow.transports._nixl_descs import (
    Described,
    LocalIndex,
    RegionInfo,
    describe,
    pack_address,
    stripe,
)
from refitflow.transports._nixl_peers import Peers
from refitflow.transports._nixl_poster import Poster
from refitflow.transports._nixl_prepared import PreparedReads, announce, release
from refitflow.transports._nixl_state import CacheKey, _Local, _Prepared
from refitflow.transports._nixl_transfer import Posted
from refitflow.transports.base import Read, Transport

__all__ = ["NixlTransport"]

log = logging.getLogger(__name__)

_MIN_STRIPE = 4 << 20  # smallest part of a read worth its own agent
_LINGERING: list[Any] = []  # what abandoned READs may still land in, after their transport closed


class NixlTransport(Transport):
    name = "nixl"

    def __init__(
        self, *, agent_name: str | None = None, num_agents: int = 1, progress_interval_s: float = 0.005,
        cache_groups: int = 16, dead_peer_s: float | None = 5.0,
    ) -> None:  # fmt: skip
        if num_agents < 1:
            raise ConfigError(f"num_agents must be at least 1, got {num_agents}")
        name = agent_name or f"refitflow-{uuid.uuid4().hex[:12]}"
        self._agents = [
            LockedAgent(name if i == 0 else f"{name}-stripe{i}", progress_interval_s=progress_interval_s,
                        dead_peer_s=dead_peer_s)
            for i in range(num_agents)
        ]
        self._nx = self._agents[0]  # the one peers know: owner of the address, progressed by a thread
        self._local: dict[int, _Local] = {}
        self._by_ptr: dict[tuple[int, int], int] = {}
        self._ids = itertools.count()
        self._index: LocalIndex | None = None
        self._address: SourceAddress | None = None
        self._reads = PreparedReads(cache_groups)  # described and prepared reads by key, kept per group
        self._posters: dict[int, Poster] = {}  # id(agent) -> its poster thread (``submit``), made on first use
        self._peers = Peers(self._agents, self._forget)  # addresses, connections, READs in flight
        self._closed = False
        self.prep_seconds = 0.0  # time spent describing reads and preparing descriptors

    @property
    def agent(self) -> str:
        return self._nx.name

    # -- local memory -------------------------------------------------------------------------------

    def register(self, tensor: torch.Tensor) -> int:
        self._check_open()
        if not tensor.is_contiguous():
            raise TransportError("only contiguous tensors can be registered")
        nbytes = tensor.numel() * tensor.element_size()
        key = (tensor.data_ptr(), nbytes)
        if key in self._by_ptr:
            return self._by_ptr[key]
        if tensor.device.type == "cpu":
            mem, devid = "DRAM", 0
        elif tensor.device.type == "cuda":
            mem, devid = "VRAM", tensor.get_device()
            for nx in self._agents:
                nx.cuda = devid if nx.cuda is None else nx.cuda  # its threads need a CUDA context from now on
        else:
            raise TransportError(f"nixl cannot register memory on {tensor.device}")
        local = _Local(tensor.detach(), RegionInfo(tensor.data_ptr(), nbytes, devid, mem), [])
        try:
            for nx in self._agents if nbytes else []:
                dlist = nx.call("register_memory", nx.agent.register_memory, [(key[0], nbytes, devid, "")], mem)
                if dlist is None:
                    raise TransportError(f"nixl refused to register {nbytes} bytes of {mem}")
                local.dlists.append(dlist)
        except BaseException:
            self._deregister(local)
            raise
        region = next(self._ids)
        self._local[region] = local
        self._by_ptr[key] = region
        self._changed()
        return region

    def deregister(self, region: int) -> None:
        local = self._local.pop(region, None)
        if local is None:
            return
        self._by_ptr.pop((local.info.addr, local.info.nbytes), None)
        self._reads.forget_local(region)  # what lands in it, and nothing else
        self._changed()
        self._deregister(local)

    def _deregister(self, local: _Local) -> None:
        for nx, dlist in zip(self._agents, local.dlists, strict=False):
            nx.call("deregister_memory", nx.agent.deregister_memory, dlist)
        local.dlists.clear()

    def _changed(self) -> None:
        self._address = None
        self._index = None

    def address(self) -> SourceAddress:
        self._check_open()
        # only an agent that announces its memory is a data owner peers connect to: it alone needs the
        # progress thread (a pure reader progresses its own transfers while it polls them)
        self._nx.start_progress()
        if self._address is None:
            md = self._nx.call("get_agent_metadata", self._nx.agent.get_agent_metadata)
            table = {rid: loc.info for rid, loc in self._local.items() if loc.info.nbytes}
            self._address = SourceAddress(transport=self.name, agent=self.agent, metadata=pack_address(table, md))
        return self._address

    # -- peers ----------------------------------------------------------------------------------------

    def connect(self, source: SourceAddress) -> None:
        self._check_open()
        if source.transport != self.name:
            raise TransportError(f"nixl cannot reach a {source.transport!r} source")
        self._peers.connect(source)

    def reconnect(self, peers: Iterable[str]) -> None:
        self._peers.reconnect(peers)

    async def quiesce(self, within: float) -> None:
        await self._peers.flights.quiesce(within)

    # -- reads ----------------------------------------------------------------------------------------

    async def read(self, reads: Sequence[Read], *, key: Hashable | None = None, count: bool = True) -> None:
        """Post every read, wait for all of them. A peer found disconnected is dropped and the read tried once
        more, connecting afresh: after a network partition healed, UCX's endpoint to a live peer may be dead
        (its keepalive gave up during the partition) while a new one connects; a peer that is really gone
        fails the second try at once."""
        drops = self._peers.drops
        try:
            await self._read(reads, key=key, count=count)
        except TransportError as exc:
            if not isinstance(exc.__cause__, self._nx.disconnected) and self._peers.drops == drops:
                raise  # neither disconnected nor a connection dropped under it
            log.info("nixl: a peer was disconnected (%s); reading again over a new connection", exc)
            try:
                await self._read(reads, key=key, count=count)
            except TransportError as again:
                raise TransportError(f"{exc.reason}; reading again over a new connection failed too: "
                                     f"{again.reason}") from again  # fmt: skip

    async def _read(self, reads: Sequence[Read], *, key: Hashable | None, count: bool) -> None:
        posted = await self.submit(reads, key=key, count=count)
        try:
            await posted.settle()
        except BaseException:  # cancelled (a read deadline): the READs still in progress are checked to their end
            posted.abandon()
            raise
        if (exc := posted.failure()) is not None:
            raise exc

    async def submit(self, reads: Sequence[Read], *, key: Hashable | None = None, count: bool = True) -> Posted:
        """Prepare (or find prepared) and hand the reads to each agent's poster thread; return at once. The bytes
        land while the caller goes on; ``await submitted.wait()`` returns once they have (see ``Posted``)."""
        batch, ckeys = await self._batch(reads, key)
        for p, _ in batch:
            if id(p.nx) not in self._posters:
                self._posters[id(p.nx)] = Poster(p.nx)
        ended = lambda failed: self._ended(batch, ckeys, failed=failed, key=key)  # noqa: E731
        drops = self._peers.drops
        dropped = lambda: self._peers.drops != drops  # noqa: E731  (a connection dropped since: a failure may be that)
        return Posted(self, reads, key, count, batch, self._posters, self._peers.flights, ended, dropped)

    def _ended(
        self, batch: list[tuple[_Prepared, str]], ckeys: list[CacheKey | None], *, failed: bool, key: Hashable = None
    ) -> None:
        """A read's transfers ended: a failed read's cached preparations are forgotten (they may name a dead
        connection), an uncached read's released."""
        if failed:
            self._forget(lambda k: k in ckeys)
            for p, _ in batch:
                release(p)  # idempotent; also covers uncached ones
        elif key is None:
            for p, _ in batch:
                release(p)

    async def _batch(
        self, reads: Sequence[Read], key: Hashable | None
    ) -> tuple[list[tuple[_Prepared, str]], list[CacheKey | None]]:
        """Every peer's transfer (and stripe) of ``reads``: found prepared under ``key``, or prepared now; each
        agent's peers told a read is coming."""
        self._check_open()
        state = self._peers.state()
        if key is not None and not self._peers.flights.dropping() and (found := self._reads.batch(key, reads, state)):
            announce(found[0])  # a replay: the very transfers prepared last time, none released since
            return found
        t0 = time.perf_counter()
        while self._index is None:  # thousands of registrations take milliseconds to sort: off the loop
            infos = {rid: loc.info for rid, loc in self._local.items()}
            index = await off_loop(LocalIndex, infos) if len(infos) > 256 else LocalIndex(infos)
            if infos.keys() == self._local.keys():  # region ids are never reused: else one came or went, sort again
                self._index = index
        batch: list[tuple[_Prepared, str]] = []  # every peer's transfer (and stripe), posted together
        ckeys: list[CacheKey | None] = []
        try:
            for (peer, lmem, rmem), group in (await self._describe(reads, key, state)).items():
                larr, rarr = group.larr, group.rarr
                if not self._peers.usable(peer):
                    self.prep_seconds += time.perf_counter() - t0
                    await self._peers.ready(peer)  # connection set-up, not counted as descriptor preparation
                    t0 = time.perf_counter()
                for i, (la, ra) in enumerate(stripe(larr, rarr, len(self._agents), _MIN_STRIPE)):
                    ck = None if key is None else (key, peer, lmem, rmem, i)
                    ckeys.append(ck)
                    epoch = self._peers.known[peer].epoch
                    args = (ck, self._agents[i], peer, lmem, rmem, la, ra, epoch, group.regions)
                    hit = self._reads.lookup(ck, epoch, la, ra)
                    if hit is None and len(la) > 256:  # thousands of descriptors take milliseconds: off the loop
                        hit = await off_loop(self._reads.prepare, *args)
                    batch.append((hit or self._reads.prepare(*args), peer))
            self.prep_seconds += time.perf_counter() - t0
            if key is not None:  # other peers this key was read from: the least recent let go
                self._reads.read_from(key, frozenset(peer for _, peer in batch))
            announce(batch)
        except BaseException:
            self._ended(batch, ckeys, failed=True)
            raise
        if key is not None and state == self._peers.state():  # no peer reconnected meanwhile
            self._reads.remember_batch(key, reads, state, (batch, ckeys))
        return batch, ckeys

    async def _describe(
        self, reads: Sequence[Read], key: Hashable | None, state: tuple[tuple[str, int], ...]
    ) -> Described:
        """The reads as numpy descriptor tables per (peer, memory types); replayed for the same list object and
        ``state``.

        Describing is one Python pass over the reads: many of them are described off the event loop."""
        if key is not None:
            found = self._reads.described(key, reads, state)
            if found is not None:
                return found
        regions = self._peers.regions()
        assert self._index is not None  # built by _batch first
        todo = [r for r in reads if r.nbytes]
        if len(todo) > 256:
            described = await off_loop(describe, todo, regions, self._index)  # 1 ms switches
        else:
            described = describe(todo, regions, self._index)
        if key is not None:
            self._reads.remember(key, reads, state, described)
        return described

    def forget(self, group: Hashable) -> None:
        """Drop what was prepared for reads whose key's group is ``group`` (a plan the caller let go)."""
        self._reads.forget_group(group)

    @property
    def prepared(self) -> int:
        """Descriptor preparations made (a replay makes none)."""
        return self._reads.prepared

    @property
    def kept(self) -> int:
        """Prepared transfers kept for replay now (a key read from peer after peer keeps its last two peers')."""
        return self._reads.kept

    @property
    def served_bytes(self) -> int:
        """Bytes peers have read from this agent (reported by their READs' notifications on arrival)."""
        return self._nx.served if self._closed else self._nx.drain()

    # -- bookkeeping ----------------------------------------------------------------------------------

    def _forget(self, match: Any) -> None:
        self._reads.forget(match)

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError("transport is closed")

    async def aclose(self) -> None:
        if self._closed:
            return
        self._nx.stop_progress()
        if lingering := self._peers.flights.abandoned():  # may land after the agents are gone: their memory stays
            log.warning("nixl: closing with %d abandoned read(s) in progress; the memory they land in is kept",
                        len(lingering))  # fmt: skip
            _LINGERING.append((lingering, [loc.tensor for loc in self._local.values()]))
        for poster in self._posters.values():
            poster.close()  # what was submitted ends first
        self._posters.clear()
        self._reads.clear()
        for agent in list(self._peers.known):
            self._peers.remove(agent)  # every READ ended (or its poster stopped): the agents go next
        for region in list(self._local):
            try:
                self.deregister(region)
            except TransportError:
                pass
        self._closed = True
        for nx in self._agents:
            nx.close()
