"""The NIXL transport: one-sided READs of peers' registered memory (UCX; cma between local processes).

``nixl`` is imported when a ``NixlTransport`` is created, never at package import. One agent per
transport, driven under one lock (see ``_nixl_agent``); every NIXL failure becomes a
``TransportError``. Reads are described as vectorised Nx3 descriptor arrays, coalesced, and run
off the event loop. A read ``key`` (a cached plan's bucket) keeps its prepared descriptor lists
and transfer handle: a replay compares the new descriptor arrays with the cached ones (cheap
numpy equality) and only reposts the handle. A peer whose metadata changed, or a local
deregistration, invalidates what was prepared against it.

Registered tensors are referenced for as long as they are registered: NIXL over cma does not
enforce remote deregistration, so memory a peer may still read must not be freed and reused.
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.to_thread
import numpy as np
import torch

from refitflow.core.errors import TransportError
from refitflow.core.types import SourceAddress
from refitflow.transports._nixl_agent import LockedAgent
from refitflow.transports._nixl_descs import LocalIndex, RegionInfo, coalesce, descs, pack_address, unpack_address
from refitflow.transports.base import Read, Transport

__all__ = ["NixlTransport"]

_EPOCHS = itertools.count(1)
_VARIANTS = 2  # prepared variants kept per key: shadow mode alternates between two landing storages


@dataclass(slots=True)
class _Local:
    tensor: torch.Tensor  # keeps the memory alive while registered
    info: RegionInfo
    dlist: Any  # nixlRegDList, None for empty tensors


@dataclass(slots=True)
class _Peer:
    address: bytes
    regions: dict[int, RegionInfo]
    epoch: int
    md: bytes  # NIXL agent metadata, loaded into the agent on first read (off the event loop)
    loaded: bool = False


@dataclass(slots=True)
class _Prepared:
    larr: np.ndarray
    rarr: np.ndarray
    epochs: tuple[int, int]  # (peer epoch, local epoch) it was prepared under
    handles: tuple[Any, ...]  # (local dlist, remote dlist, xfer handle)


class NixlTransport(Transport):
    name = "nixl"

    def __init__(
        self, *, agent_name: str | None = None, progress_interval_s: float = 0.005, cache_size: int = 1024
    ) -> None:
        name = agent_name or f"refitflow-{uuid.uuid4().hex[:12]}"
        self._nx = LockedAgent(name, progress_interval_s=progress_interval_s)
        self._local: dict[int, _Local] = {}
        self._by_ptr: dict[tuple[int, int], int] = {}
        self._ids = itertools.count()
        self._index: LocalIndex | None = None
        self._address: SourceAddress | None = None
        self._local_epoch = 0
        self._peers: dict[str, _Peer] = {}
        self._cache: OrderedDict[tuple[Hashable, str, str, str], list[_Prepared]] = OrderedDict()
        self._cache_size = cache_size
        self._closed = False
        self.prepared = 0  # descriptor preparations made (a replay makes none)
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
        else:
            raise TransportError(f"nixl cannot register memory on {tensor.device}")
        info = RegionInfo(tensor.data_ptr(), nbytes, devid, mem)
        dlist = None
        if nbytes:
            rows = [(info.addr, nbytes, devid, "")]
            dlist = self._nx.call("register_memory", self._nx.agent.register_memory, rows, mem)
            if dlist is None:
                raise TransportError(f"nixl refused to register {nbytes} bytes of {mem}")
        region = next(self._ids)
        self._local[region] = _Local(tensor.detach(), info, dlist)
        self._by_ptr[key] = region
        self._changed()
        self._nx.start_progress()
        return region

    def deregister(self, region: int) -> None:
        local = self._local.pop(region, None)
        if local is None:
            return
        self._by_ptr.pop((local.info.addr, local.info.nbytes), None)
        self._local_epoch += 1  # prepared local descriptors may name this registration
        self._changed()
        if local.dlist is not None and not self._closed:
            self._nx.call("deregister_memory", self._nx.agent.deregister_memory, local.dlist)

    def _changed(self) -> None:
        self._address = None
        self._index = None

    def address(self) -> SourceAddress:
        self._check_open()
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
        peer = self._peers.get(source.agent)
        if peer is not None and peer.address == source.metadata:
            return
        regions, md = unpack_address(source.metadata)
        self._forget(lambda k: k[1] == source.agent)  # prepared against the old snapshot
        self._peers[source.agent] = _Peer(source.metadata, regions, next(_EPOCHS), md)

    async def _load(self, agent: str) -> None:
        """Give NIXL the peer's metadata (a refresh if it knew an older snapshot): ~10 ms, so off the loop."""
        peer = self._peers[agent]
        name = await anyio.to_thread.run_sync(
            self._nx.call, "add_remote_agent", self._nx.agent.add_remote_agent, peer.md
        )
        name = name.decode() if isinstance(name, bytes) else str(name)
        if name != agent:
            raise TransportError(f"address of {agent!r} carries the metadata of agent {name!r}")
        peer.loaded = True

    def _drop_peer(self, agent: str) -> None:
        self._forget(lambda k: k[1] == agent)
        peer = self._peers.pop(agent, None)
        if peer is not None and peer.loaded:
            try:
                self._nx.call("remove_remote_agent", self._nx.agent.remove_remote_agent, agent)
            except TransportError:
                pass  # already unusable; connect() adds it afresh

    # -- reads ----------------------------------------------------------------------------------------

    async def read(self, reads: Sequence[Read], *, key: Hashable | None = None) -> None:
        self._check_open()
        t0 = time.perf_counter()
        for (peer, lmem, rmem), (larr, rarr) in self._describe([r for r in reads if r.nbytes]).items():
            ckey = None if key is None else (key, peer, lmem, rmem)
            if not self._peers[peer].loaded:
                self.prep_seconds += time.perf_counter() - t0
                await self._load(peer)  # connection set-up, not counted as descriptor preparation
                t0 = time.perf_counter()
            prepared = self._prepare(ckey, peer, lmem, rmem, larr, rarr)
            self.prep_seconds += time.perf_counter() - t0
            try:
                await self._transfer(prepared.handles[2], peer)
            except BaseException:
                self._forget(lambda k, ck=ckey: k == ck)
                self._release(prepared)  # idempotent; also covers an uncached one
                raise
            if ckey is None:
                self._release(prepared)
            t0 = time.perf_counter()

    def _describe(self, reads: Sequence[Read]) -> dict[tuple[str, str, str], tuple[np.ndarray, np.ndarray]]:
        """Per (peer, local mem, remote mem): coalesced local and remote Nx3 descriptor arrays."""
        n = len(reads)
        rows: list[tuple[int, int, int, int, int]] = []  # remote addr, region, devid, local addr, nbytes
        groups: dict[tuple[str, str], list[int]] = {}
        for i, r in enumerate(reads):
            peer = self._peers.get(r.peer)
            info = None if peer is None else peer.regions.get(r.region)
            if info is None:
                why = "is not connected" if peer is None else f"has no region {r.region}"
                raise TransportError(f"nixl peer {r.peer!r} {why}")
            if r.offset < 0 or r.offset + r.nbytes > info.nbytes or r.dst.nbytes != r.nbytes:
                raise TransportError(f"read [{r.offset}, +{r.nbytes}) outside region {r.region} of {r.peer!r}")
            rows.append((info.addr + r.offset, r.region, info.devid, r.dst.data_ptr(), r.nbytes))
            groups.setdefault((r.peer, info.mem), []).append(i)
        table = np.array(rows, dtype=np.uint64).reshape(n, 5)
        raddr, rkey, rdev, laddr, nbytes = table.T
        if self._index is None:
            self._index = LocalIndex({rid: loc.info for rid, loc in self._local.items()})
        infos = self._index.infos
        lpos = self._index.locate(laddr, nbytes) if n else np.empty(0, dtype=np.int64)
        ldev = np.array([i.devid for i in infos], dtype=np.uint64)[lpos]
        lvram = np.array([i.mem == "VRAM" for i in infos], dtype=bool)[lpos]
        out = {}
        for (agent, rmem), members in groups.items():
            idx = np.asarray(members, dtype=np.int64)
            for lmem, sel in (("DRAM", idx[~lvram[idx]]), ("VRAM", idx[lvram[idx]])):
                if len(sel):
                    la, ra, nb, first = coalesce(laddr[sel], raddr[sel], nbytes[sel], lpos[sel], rkey[sel])
                    out[(agent, lmem, rmem)] = (descs(la, nb, ldev[sel][first]), descs(ra, nb, rdev[sel][first]))
        return out

    def _prepare(
        self, ckey: tuple[Hashable, str, str, str] | None, peer: str, lmem: str, rmem: str,
        larr: np.ndarray, rarr: np.ndarray,
    ) -> _Prepared:  # fmt: skip
        """The cached transfer for these exact arrays, or a freshly prepared one (cached under ``ckey``)."""
        epochs = (self._peers[peer].epoch, self._local_epoch)
        variants = self._cache.get(ckey, []) if ckey is not None else []
        for p in variants:
            if p.epochs == epochs and np.array_equal(p.larr, larr) and np.array_equal(p.rarr, rarr):
                if ckey is not None:
                    self._cache.move_to_end(ckey)
                return p
        agent, handles = self._nx.agent, []
        try:
            with self._nx.lock, self._nx.translated("descriptor preparation"):
                handles.append(agent.prep_xfer_dlist("NIXL_INIT_AGENT", larr, lmem))
                handles.append(agent.prep_xfer_dlist(peer, rarr, rmem))
                idx = np.arange(len(larr), dtype=np.int64)
                handles.append(agent.make_prepped_xfer("READ", handles[0], idx, handles[1], idx))
        except BaseException:
            self._release(_Prepared(larr, rarr, epochs, tuple(handles)))
            raise
        self.prepared += 1
        prepared = _Prepared(larr, rarr, epochs, tuple(handles))
        if ckey is not None:
            variants = [*variants, prepared]
            for old in variants[:-_VARIANTS]:
                self._release(old)
            self._cache[ckey] = variants[-_VARIANTS:]
            self._cache.move_to_end(ckey)
            while len(self._cache) > self._cache_size:
                for old in self._cache.popitem(last=False)[1]:
                    self._release(old)
        return prepared

    async def _transfer(self, handle: Any, peer: str) -> None:
        """Post the READ off the event loop; poll a pending one with growing sleeps (no spinning)."""

        def post() -> str:
            return str(self._nx.call("transfer", self._nx.agent.transfer, handle))

        try:
            state = await anyio.to_thread.run_sync(post)
            delay = 50e-6
            while state == "PROC":
                await anyio.sleep(delay)
                delay = min(delay * 2, 0.002)
                state = self._nx.try_state(handle) or "PROC"
        except TransportError as exc:
            if isinstance(exc.__cause__, self._nx.disconnected):
                self._drop_peer(peer)
            raise
        if state != "DONE":
            raise TransportError(f"nixl READ from {peer!r} ended in state {state}")

    # -- bookkeeping ----------------------------------------------------------------------------------

    def _release(self, prepared: _Prepared) -> None:
        for h in reversed(prepared.handles):
            try:
                with self._nx.lock, self._nx.translated("handle release"):
                    h.release()
            except TransportError:
                pass  # e.g. a transfer to a dead peer that cannot be cancelled: nothing more to do

    def _forget(self, match: Any) -> None:
        for ckey in [k for k in self._cache if match(k)]:
            for p in self._cache.pop(ckey):
                self._release(p)

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError("transport is closed")

    async def aclose(self) -> None:
        if self._closed:
            return
        self._nx.stop_progress()
        self._forget(lambda k: True)
        for agent in list(self._peers):
            self._drop_peer(agent)
        for region in list(self._local):
            try:
                self.deregister(region)
            except TransportError:
                pass
        self._closed = True
