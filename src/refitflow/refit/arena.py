"""The staging arena: per device, one buffer handed out as a ring; every device's ring counted in one budget.

Buckets are allocated and freed in order, so a ring never fragments; placement depends only on
the sequence of sizes, so a replayed plan lands at the same offsets every time (a transport can
prepare its descriptors once). Every byte handed out is counted against the ``ByteBudget``.

Staging lives on the device of the parameters it feeds (VRAM for CUDA parameters: a transfer lands
there, and the copies and casts out of it stay on the device). A destination spread over ``n``
devices gives each device's ring ``budget // n`` bytes, so the memory allocated for staging never
exceeds the budget (buckets are cut to fit one share); a ring is allocated on first use only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from refitflow.core.errors import ConfigError
from refitflow.refit.budget import ByteBudget

__all__ = ["Lease", "StagingArena", "StagingArenas"]


@dataclass(frozen=True, slots=True)
class Lease:
    """Staging bytes held against the budget: ``nbytes`` at ``offset`` of a ring, as a uint8 ``view``."""

    offset: int
    nbytes: int
    view: torch.Tensor  # uint8

Register = Callable[[torch.Tensor], object]


class StagingArena:
    """One ring of ``capacity`` bytes (default: the whole budget) on one device."""

    def __init__(
        self,
        budget: ByteBudget,
        *,
        device: torch.device | str = "cpu",
        capacity: int | None = None,
        register: Register | None = None,
    ) -> None:
        self.budget = budget
        self.capacity = budget.capacity_bytes if capacity is None else capacity
        if not 0 < self.capacity <= budget.capacity_bytes:
            raise ConfigError(f"an arena of {self.capacity} bytes does not fit a budget of {budget.capacity_bytes}")
        self.device = torch.device(device)
        self._register = register
        self._buffer: torch.Tensor | None = None
        self._live: list[Lease] = []

    @property
    def buffer(self) -> torch.Tensor:
        """The arena's memory, allocated (and registered) on first use."""
        if self._buffer is None:
            self._buffer = torch.empty(self.capacity, dtype=torch.uint8, device=self.device)
            if self._register is not None:
                self._register(self._buffer)
        return self._buffer

    @property
    def allocated(self) -> bool:
        return self._buffer is not None

    def _place(self, nbytes: int) -> int | None:
        cap = self.capacity
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
        if nbytes > self.capacity:
            raise ConfigError(f"{nbytes} bytes can never fit the {self.capacity}-byte staging ring on {self.device}")
        while (offset := self._place(nbytes)) is None:
            await self.budget.wait_for_release()
        self.budget.acquire_nowait(nbytes)  # leases are disjoint inside the arenas: this always fits
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


class StagingArenas:
    """The receiver's staging: one ring per device, shares of one budget."""

    def __init__(
        self, budget: ByteBudget, devices: Iterable[torch.device | str], *, register: Register | None = None
    ) -> None:
        names = list(dict.fromkeys(str(torch.device(d)) for d in devices))
        if not names:
            raise ConfigError("staging needs at least one device")
        share = budget.capacity_bytes // len(names)
        self.share = share
        self._rings = {name: StagingArena(budget, device=name, capacity=share, register=register) for name in names}

    @property
    def allocated_bytes(self) -> int:
        """Staging memory allocated so far, on every device (a ring is allocated on first use)."""
        return sum(r.capacity for r in self._rings.values() if r.allocated)

    def ring(self, device: str) -> StagingArena:
        ring = self._rings.get(str(torch.device(device)))
        if ring is None:
            raise ConfigError(f"no staging on {device}: the destination has no parameter there")
        return ring

    async def allocate(self, nbytes: int, device: str) -> Lease:
        return await self.ring(device).allocate(nbytes)

    def free(self, lease: Lease) -> None:
        if lease.nbytes:
            self.ring(str(lease.view.device)).free(lease)

    def free_all(self) -> None:
        for ring in self._rings.values():
            ring.free_all()
