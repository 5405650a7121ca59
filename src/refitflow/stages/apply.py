"""Apply: copy (and cast) translated staging views into their destinations, off the event loop.

The copies are issued on the refit streams of the bucket's devices (``Devices.use``) and marked
(``Devices.record``): on CUDA they may still run when apply passes the bucket on; verify waits for
the marks before the staging they read is freed, and commit drains every stream before prepare.
"""

from __future__ import annotations

import time
from typing import Any

import anyio.to_thread
from anyio.abc import ObjectReceiveStream, ObjectSendStream

from refitflow.stages._context import Devices, StageContext, Work

__all__ = ["run", "write"]


def _copy_all(devices: Devices, work: Work) -> tuple[Any, ...]:
    """Issue the bucket's copies on its refit streams (in the worker thread) and mark them."""
    with devices.use(work.bucket.devices):
        for dst, src in work.copies:
            dst.copy_(src if src.shape == dst.shape else src.reshape(dst.shape))
        return devices.record(work.bucket.devices)


async def write(ctx: StageContext, work: Work) -> None:
    """Write one bucket's copies into their destinations (marking the attempt written first)."""
    if work.copies:
        assert ctx.attempt is not None
        ctx.attempt.mark_written()
        work.marks = await anyio.to_thread.run_sync(_copy_all, ctx.devices, work)


async def run(ctx: StageContext, receive: ObjectReceiveStream[Work], send: ObjectSendStream[Work]) -> None:
    async with receive, send:
        async for work in receive:
            ctx.enter("apply")
            t0 = time.perf_counter()
            await write(ctx, work)
            ctx.note("apply", 1, work.bucket.staging_bytes, time.perf_counter() - t0)
            await send.send(work)
