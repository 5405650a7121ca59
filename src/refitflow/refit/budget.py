"""A byte budget shaped like anyio's ``CapacityLimiter``: the staging memory a rank may hold at once."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import anyio

from refitflow.core.errors import ConfigError

__all__ = ["BudgetStatistics", "ByteBudget"]


@dataclass(frozen=True, kw_only=True)
class BudgetStatistics:
    capacity_bytes: int
    used_bytes: int
    peak_bytes: int
    waiting: int


class ByteBudget:
    """Counts staging bytes. ``acquire`` waits for room; nothing may be held beyond ``capacity_bytes``."""

    def __init__(self, capacity_bytes: int, *, on_change: Callable[[BudgetStatistics], None] | None = None) -> None:
        if not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise ConfigError(f"budget capacity must be a positive number of bytes, got {capacity_bytes!r}")
        self._capacity = capacity_bytes
        self._used = 0
        self._peak = 0
        self._waiting = 0
        self._freed = anyio.Event()
        self._on_change = on_change

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    def acquire_nowait(self, nbytes: int) -> None:
        """Take ``nbytes`` now or raise ``anyio.WouldBlock``."""
        self._check(nbytes)
        if self._used + nbytes > self._capacity:
            raise anyio.WouldBlock
        self._used += nbytes
        self._peak = max(self._peak, self._used)
        self._changed()

    async def acquire(self, nbytes: int) -> None:
        """Take ``nbytes``, waiting until enough has been released."""
        self._check(nbytes)
        while True:
            try:
                self.acquire_nowait(nbytes)
                return
            except anyio.WouldBlock:
                self._waiting += 1
                try:
                    await self.wait_for_release()
                finally:
                    self._waiting -= 1

    async def wait_for_release(self) -> None:
        """Return at the next ``release``."""
        await self._freed.wait()

    def release(self, nbytes: int) -> None:
        if nbytes < 0 or nbytes > self._used:
            raise RuntimeError(f"releasing {nbytes} bytes but only {self._used} are held")
        self._used -= nbytes
        self._freed.set()
        self._freed = anyio.Event()
        self._changed()

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change(self.statistics())

    def reset_peak(self) -> None:
        self._peak = self._used

    def statistics(self) -> BudgetStatistics:
        return BudgetStatistics(
            capacity_bytes=self._capacity, used_bytes=self._used, peak_bytes=self._peak, waiting=self._waiting
        )

    def _check(self, nbytes: int) -> None:
        if nbytes < 0:
            raise ValueError("cannot acquire a negative number of bytes")
        if nbytes > self._capacity:
            raise ConfigError(f"{nbytes} bytes can never fit a budget of {self._capacity} bytes")
