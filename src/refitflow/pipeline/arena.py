"""The staging arena: one buffer of exactly ``budget`` bytes, handed out as a ring.

Buckets are allocated and freed in order, so a ring never fragments; placement depends only on
the sequence of sizes, so a replayed plan lands at the same offsets every time (a transport can
prepare its descriptors once). Every byte handed out is counted against the ``ByteBudget``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from refitflow.pipeline.budget import ByteBudget
from refitflow.stages._context import Lease

__all__ = ["StagingArena"]


class StagingArena:
    def __init__(
        self,
        budget: ByteBudget,
        *,
        device: torch.device | str = "cpu",
        register: Callable[[torch.Tensor], object] | None = None,
    ) -> None:
        self.budget = budget
        self._device = torch.device(device)
        self._register = register
        self._buffer: torch.Tensor | None = None
        self._live: list[Lease] = []

    @property
    def buffer(self) -> torch.Tensor:
        """The arena's memory, allocated (and registered) on first use."""
        if self._buffer is None:
            self._buffer = torch.empty(self.budget.capacity_bytes, dtype=torch.uint8, device=self._device)
            if self._register is not None:
                self._register(self._buffer)
        return self._buffer

    def _place(self, nbytes: int) -> int | None:
        cap = self.budget.capacity_bytes
        if not self._live:
            return 0
        tail = self._live[0].offset
        head = self._live[-1].offset + self._live[-1].nbytes
        if head > tail:  # live bytes in [tail, head): room after head, or before tail
            if head + nbytes <= cap:
                return head
            return 0 if nbytes <= tail else None
        return head if head + nbytes <= tail else None  # wrapped: room between head and tail

    async def allocate(self, nbytes: int) -> Lease:
        """Lease ``nbytes`` of staging, waiting until the ring has room."""
        buffer = self.buffer  # allocated on first use: if that fails, nothing is held
        if nbytes == 0:
            return Lease(0, 0, buffer[:0])
        while (offset := self._place(nbytes)) is None:
            await self.budget.wait_for_release()
        self.budget.acquire_nowait(nbytes)  # leases are disjoint inside the arena: this always fits
        lease = Lease(offset, nbytes, buffer[offset : offset + nbytes])
        self._live.append(lease)
        return lease

    def free(self, lease: Lease) -> None:
        if lease.nbytes == 0:
            return
        self._live.remove(lease)
        self.budget.release(lease.nbytes)

    def free_all(self) -> None:
        for lease in list(self._live):
            self.free(lease)
