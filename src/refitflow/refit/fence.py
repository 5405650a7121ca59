"""The serving gate of a rank: ``ready``, ``updating`` or ``fenced``."""

from __future__ import annotations

import enum
from collections.abc import Callable

import anyio

from refitflow.core.errors import FencedError, RefitTimeoutError

__all__ = ["Fence", "FenceState"]


class FenceState(enum.StrEnum):
    READY = "ready"
    UPDATING = "updating"
    FENCED = "fenced"


class Fence:
    """Inference code calls ``check()`` (or awaits ``wait_ready``) before serving a request."""

    def __init__(self, on_change: Callable[[FenceState], None] | None = None) -> None:
        self._state = FenceState.READY
        self._reason: str | None = None
        self._changed = anyio.Event()
        self._on_change = on_change

    @property
    def state(self) -> FenceState:
        return self._state

    @property
    def reason(self) -> str | None:
        """Why the fence is closed (``None`` when ready)."""
        return self._reason

    def check(self) -> None:
        """Raise ``FencedError`` unless the rank serves a complete version."""
        if self._state is not FenceState.READY:
            raise FencedError(f"rank is {self._state.value}: {self._reason or 'update in progress'}")

    async def wait_ready(self, timeout: float) -> None:
        """Wait until the fence is ready; a fenced rank raises at once."""
        with anyio.move_on_after(timeout) as scope:
            while self._state is not FenceState.READY:
                if self._state is FenceState.FENCED:
                    self.check()
                await self._changed.wait()
        if scope.cancelled_caught:
            raise RefitTimeoutError(f"fence not ready after {timeout} s")

    def set(self, state: FenceState, reason: str | None = None) -> None:
        self._state = state
        self._reason = None if state is FenceState.READY else reason
        self._changed.set()
        self._changed = anyio.Event()
        if self._on_change is not None:
            self._on_change(state)
