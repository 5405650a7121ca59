"""In-process transport: peers are other ``LoopbackTransport`` agents in this process.

It is the stand-in every pipeline test can use (as httpx tests use ``MockTransport``): reads copy
bytes from the peer's registered memory, off the event loop when they are large or touch a device.
Either side may be CPU or CUDA memory: like a real transport, ``read`` returns only when every byte
has landed (a device copy is waited for in the worker thread).
"""

from __future__ import annotations

import itertools
import uuid
import weakref
from collections.abc import Hashable, Sequence

import anyio.to_thread
import torch

from refitflow.core.errors import TransportError
from refitflow.core.types import SourceAddress
from refitflow.transports.base import Read, Transport, as_bytes

__all__ = ["LoopbackTransport"]

_AGENTS: weakref.WeakValueDictionary[str, LoopbackTransport] = weakref.WeakValueDictionary()
_OFFLOAD_BYTES = 1 << 20


class LoopbackTransport(Transport):
    name = "loopback"

    def __init__(self) -> None:
        self._agent = f"loopback-{uuid.uuid4().hex[:12]}"
        self._regions: dict[int, torch.Tensor] = {}
        self._by_ptr: dict[tuple[int, int], int] = {}
        self._ids = itertools.count()
        self._closed = False
        self._served = 0
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
            self._by_ptr = {k: v for k, v in self._by_ptr.items() if v != region}

    def address(self) -> SourceAddress:
        return SourceAddress(transport=self.name, agent=self._agent)

    def connect(self, source: SourceAddress) -> None:
        if source.transport != self.name:
            raise TransportError(f"loopback cannot reach a {source.transport!r} source")

    def _source_bytes(self, read: Read) -> torch.Tensor:
        peer = _AGENTS.get(read.peer)
        if peer is None or peer._closed:
            raise TransportError(f"loopback peer {read.peer!r} is gone")
        region = peer._regions.get(read.region)
        if region is None:
            raise TransportError(f"peer {read.peer!r} has no region {read.region}")
        if read.offset + read.nbytes > region.numel() or read.dst.numel() != read.nbytes:
            raise TransportError(f"read [{read.offset}, +{read.nbytes}) outside region {read.region}")
        peer._served += read.nbytes
        return region[read.offset : read.offset + read.nbytes]

    @property
    def served_bytes(self) -> int:
        return self._served

    async def read(self, reads: Sequence[Read], *, key: Hashable | None = None) -> None:
        if self._closed:
            raise TransportError("transport is closed")
        pairs = [(r.dst, self._source_bytes(r)) for r in reads]
        cuda = {t.device for pair in pairs for t in pair if t.device.type == "cuda"}

        def copy() -> None:
            for dst, src in pairs:
                dst.copy_(src)
            for device in cuda:  # device-to-device copies are asynchronous: land them before returning
                torch.cuda.current_stream(device).synchronize()

        if cuda or sum(r.nbytes for r in reads) >= _OFFLOAD_BYTES:
            await anyio.to_thread.run_sync(copy)
        else:
            copy()

    async def aclose(self) -> None:
        self._closed = True
        self._regions.clear()
        self._by_ptr.clear()
        _AGENTS.pop(self._agent, None)
