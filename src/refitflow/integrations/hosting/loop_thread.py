"""A dedicated event-loop thread, for hosts that call refitflow synchronously (an engine's worker).

An inference engine's worker calls its weight-transfer hooks as plain blocking methods, from the
thread that also runs the model. ``LoopThread`` keeps refitflow's asyncio loop (its receiver,
transport and vote sockets) alive in a thread of its own across those calls — built on anyio's
blocking portal — and runs each call there under a deadline: the coroutine is cancelled at
``timeout`` and the caller stops waiting ``grace_s`` later even if it did not end.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Awaitable, Callable
from contextlib import AbstractContextManager
from typing import Any, TypeVar

import anyio
import anyio.from_thread

from refitflow.core.errors import ConfigError, RefitTimeoutError

__all__ = ["LoopThread"]

T = TypeVar("T")


class LoopThread:
    def __init__(self, name: str = "refitflow-loop", *, grace_s: float = 10.0) -> None:
        self.grace_s = grace_s
        self._cm: AbstractContextManager[anyio.from_thread.BlockingPortal] = anyio.from_thread.start_blocking_portal(
            name=name
        )
        self._portal: anyio.from_thread.BlockingPortal | None = self._cm.__enter__()
        # a host that never closes it (verl has no hook for it) must still exit: the interpreter joins its
        # threads before atexit runs, so close where concurrent.futures stops its own workers, and first
        threading._register_atexit(self.close)  # type: ignore[attr-defined]

    def run(self, fn: Callable[..., Awaitable[T]], *args: Any, timeout: float, what: str = "call", **kwargs: Any) -> T:
        """Run ``await fn(*args, **kwargs)`` on the loop thread; block until it returns, raises or times out."""
        future = self.start(fn, *args, timeout=timeout, what=what, **kwargs)
        try:
            return future.result(timeout=timeout + self.grace_s)
        except concurrent.futures.TimeoutError as exc:
            future.cancel()
            raise RefitTimeoutError(f"{what} did not end within {timeout} s (+{self.grace_s} s grace)") from exc

    def start(
        self, fn: Callable[..., Awaitable[T]], *args: Any, timeout: float, what: str = "call", **kwargs: Any
    ) -> concurrent.futures.Future[T]:
        """Start ``await fn(*args, **kwargs)`` on the loop thread under ``timeout`` and return at once: its future
        (a ``RefitTimeoutError`` when the deadline passed)."""
        if self._portal is None:
            raise ConfigError("this loop thread is closed")

        async def bounded() -> T:
            try:
                with anyio.fail_after(timeout):
                    return await fn(*args, **kwargs)
            except TimeoutError as exc:
                if isinstance(exc, RefitTimeoutError):
                    raise
                raise RefitTimeoutError(f"{what} did not finish within {timeout} s") from exc

        return self._portal.start_task_soon(bounded)

    def close(self) -> None:
        """Stop the loop (waiting for tasks it still runs) and its thread."""
        if self._portal is not None:
            self._portal = None
            self._cm.__exit__(None, None, None)
