"""Stream groups of several ranks inside one test process: a real TCPStore and real gloo groups
(one per rank, each its own connections), ranks driven as tasks of one event loop."""

from __future__ import annotations

import socket
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import anyio.to_thread

from refitflow.push.group import StreamGroup, stream_group


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def groups(n: int, timeout_s: float = 20.0) -> list[StreamGroup]:
    """Rank 0 .. n-1 of one new stream group (built concurrently: each rank's rendezvous waits for all)."""
    address = f"127.0.0.1:{free_port()}"
    out: list[Any] = [None] * n

    async def join(rank: int) -> None:
        out[rank] = await anyio.to_thread.run_sync(
            lambda: stream_group(address, world_size=n, rank=rank, timeout_s=timeout_s)
        )

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            for rank in range(n):
                tg.start_soon(join, rank)
    return out


async def together(*roles: Callable[[], Awaitable[Any]], deadline: float = 120.0) -> list[Any]:
    """Run every role at once; each one's result, or the exception it raised (none cancels the others)."""
    results: list[Any] = [None] * len(roles)

    async def run(i: int) -> None:
        try:
            results[i] = await roles[i]()
        except Exception as exc:
            results[i] = exc

    with anyio.fail_after(deadline):
        async with anyio.create_task_group() as tg:
            for i in range(len(roles)):
                tg.start_soon(run, i)
    return results
