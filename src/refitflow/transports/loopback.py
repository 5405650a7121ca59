"""In-process transport: peers are other ``LoopbackTransport`` agents in this process.

It is the stand-in every pipeline test can use (as httpx tests use ``MockTransport``): reads copy
bytes from the peer's registered memory, off the event loop when they are large or touch a device.
Either side may be CPU or CUDA memory: like a real transport, ``read`` returns only when every byte
has landed (a device copy is waited for in the worker thread). A strided read
is one copy of a strided view. Reads issued again under the same ``key`` (the same list object,
no peer registration changed since) replay their prepared copies: small CPU runs are one
``memmove`` each, so a replayed refit of many small tensors costs well under a microsecond per run.
"""

from __future__ import annotations

import ctypes
import itertools
import uuid
import weakref
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import Any

import anyio.to_thread
import torch

from refitflow.core.errors import TransportError
from refitflow.core.threads import off_loop
from refitflow.core.types import SourceAddress
from refitflow.transports.base import Read, Transport, as_bytes

__all__ = ["LoopbackTransport"]

_AGENTS: weakref.WeakValueDictionary[str, LoopbackTransport] = weakref.WeakValueDictionary()
_OFFLOAD_BYTES = 1 << 20
_MEMMOVE_MAX = 1 << 20  # CPU runs up to this size are copied with memmove, larger ones by torch
_CACHE = 1024


class _Copies:
    """A list of reads turned into copies: (dst, src, n) pointers for small CPU runs, views for the rest."""

    def __init__(self) -> None:
        self.small: list[tuple[int, int, int]] = []
        self.views: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.nbytes = 0
        self.served: dict[str, int] = {}
        self.cuda: set[torch.device] = set()  # devices whose copies must land before ``run`` returns

    def run(self) -> None:
        move = ctypes.memmove
        for d, s, n in self.small:
            move(d, s, n)
        for dst, src in self.views:
            dst.copy_(src)
        for device in self.cuda:  # device copies are asynchronous: land them before returning
            torch.cuda.current_stream(device).synchronize()


class LoopbackTransport(Transport):
    name = "loopback"

    def __init__(self) -> None:
        self._agent = f"loopback-{uuid.uuid4().hex[:12]}"
        self._regions: dict[int, torch.Tensor] = {}
        self._by_ptr: dict[tuple[int, int], int] = {}
        self._ids = itertools.count()
        self._closed = False
        self._served = 0
        self.epoch = 0  # bumps when a registration goes: copies prepared against it are stale
        self._prepared: OrderedDict[Hashable, tuple[Sequence[Read], tuple[Any, ...], _Copies]] = OrderedDict()
        _AGENTS[self._agent] = self

    @property
    def agent(self) -> str:
        return self._agent

    def register(self, tensor: torch.Tensor) -> int:
        key = (tensor.data_ptr(), tensor.numel() * tensor.element_size())
        if key in self._by_ptr:
            return self._by_ptr[key]
        region = next(self._ids)
        self._regions[region] = as_bytes(tensor)
        self._by_ptr[key] = region
        return region

    def deregister(self, region: int) -> None:
        view = self._regions.pop(region, None)
        if view is not None:
            self.epoch += 1
            self._by_ptr = {k: v for k, v in self._by_ptr.items() if v != region}

    def address(self) -> SourceAddress:
        return SourceAddress(transport=self.name, agent=self._agent)

    def connect(self, source: SourceAddress) -> None:
        if source.transport != self.name:
            raise TransportError(f"loopback cannot reach a {source.transport!r} source")

    def _source_bytes(self, read: Read) -> torch.Tensor:
        """The source bytes of a read, as a (strided) view of the peer's region."""
        peer = _AGENTS.get(read.peer)
        if peer is None or peer._closed:
            raise TransportError(f"loopback peer {read.peer!r} is gone")
        region = peer._regions.get(read.region)
        if region is None:
            raise TransportError(f"peer {read.peer!r} has no region {read.region}")
        if read.low < 0 or read.low + read.extent > region.numel() or read.dst.numel() != read.total:
            raise TransportError(f"read [{read.low}, +{read.extent}) outside region {read.region}")
        if read.count == 1:
            return region[read.offset : read.offset + read.nbytes]
        up = abs(read.stride)  # torch has no negative strides: the runs upwards, turned round in ``_copies``
        return region.as_strided((read.count, read.nbytes), (up, 1), region.storage_offset() + read.low)

    def _copies(self, reads: Sequence[Read]) -> _Copies:
        out = _Copies()
        for r in reads:
            src = self._source_bytes(r)
            out.served[r.peer] = out.served.get(r.peer, 0) + r.total
            out.nbytes += r.total
            if r.count == 1 and r.nbytes <= _MEMMOVE_MAX and src.is_cpu and r.dst.is_cpu:
                out.small.append((r.dst.data_ptr(), src.data_ptr(), r.nbytes))
            elif r.nbytes:
                if r.stride < 0 and r.count > 1:  # runs downwards: each its own copy
                    rows = r.dst.view(r.count, r.nbytes)
                    out.views += [(rows[k], src[r.count - 1 - k]) for k in range(r.count)]
                else:
                    out.views.append((r.dst.view(r.count, r.nbytes) if r.count > 1 else r.dst, src))
                out.cuda |= {t.device for t in (r.dst, src) if t.device.type == "cuda"}
        return out

    def _state(self, reads: Sequence[Read]) -> tuple[Any, ...]:
        """The registrations the copies depend on: each peer's epoch (a peer gone: None)."""
        states = []
        for p in sorted({r.peer for r in reads}):
            agent = _AGENTS.get(p)
            states.append((p, None if agent is None or agent._closed else agent.epoch))
        return tuple(states)

    @property
    def served_bytes(self) -> int:
        return self._served

    async def read(self, reads: Sequence[Read], *, key: Hashable | None = None, count: bool = True) -> None:
        if self._closed:
            raise TransportError("transport is closed")
        cached = self._prepared.get(key) if key is not None else None
        state = self._state(reads) if key is not None else ()
        if cached is not None and cached[0] is reads and cached[1] == state:
            copies = cached[2]
            self._prepared.move_to_end(key)
        else:  # a first sight of many reads takes milliseconds: prepared off the event loop
            copies = await off_loop(self._copies, reads) if len(reads) > 256 else self._copies(reads)
            if key is not None:
                self._prepared[key] = (reads, state, copies)
                while len(self._prepared) > _CACHE:
                    self._prepared.popitem(last=False)
        for peer, n in copies.served.items() if count else ():
            _AGENTS[peer]._served += n
        if copies.cuda or copies.nbytes >= _OFFLOAD_BYTES:
            await anyio.to_thread.run_sync(copies.run)
        else:
            copies.run()

    async def aclose(self) -> None:
        self._closed = True
        self.epoch += 1
        self._prepared.clear()
        self._regions.clear()
        self._by_ptr.clear()
        _AGENTS.pop(self._agent, None)
