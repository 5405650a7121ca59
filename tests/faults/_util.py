"""Helpers for the fault tests: free addresses, waiting on another process's state."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable

import anyio


def free_address() -> str:
    """A loopback TCP address whose port and the next one (the registry's announcements) are free now."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with socket.socket() as t:
            try:
                t.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return f"tcp://127.0.0.1:{port}"
    raise AssertionError("no two free consecutive ports on 127.0.0.1")


async def until(check: Callable[[], Awaitable[bool]], timeout: float, what: str) -> None:
    """Poll ``check`` (state in another process: nothing to wait on) until true, under a deadline."""
    try:
        with anyio.fail_after(timeout):
            while not await check():  # noqa: ASYNC110 (state in another process)
                await asyncio.sleep(0.05)
    except TimeoutError:
        raise AssertionError(f"not within {timeout} s: {what}") from None


async def spawn_registry(address: str, *flags: str) -> asyncio.subprocess.Process:
    """``refitflow registry --bind ADDRESS`` in its own process, serving once this returns."""
    from tests.registry._procs import spawn_registry as spawn

    proc, bound = await spawn("--bind", address, *flags)
    assert bound == address, (bound, address)
    return proc
