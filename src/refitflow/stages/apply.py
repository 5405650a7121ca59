"""Apply: copy (and cast) translated staging views into their destinations, off the event loop."""

from __future__ import annotations

import time

import anyio.to_thread
from anyio.abc import ObjectReceiveStream, ObjectSendStream

from refitflow.stages._context import StageContext, Work

__all__ = ["run", "write"]


def _copy_all(copies: list) -> None:
    for dst, src in copies:
        dst.copy_(src)


async def write(ctx: StageContext, work: Work) -> None:
    """Write one bucket's copies into their destinations (marking the attempt written first)."""
    if work.copies:
        assert ctx.attempt is not None
        ctx.attempt.mark_written()
        await anyio.to_thread.run_sync(_copy_all, work.copies)


async def run(ctx: StageContext, receive: ObjectReceiveStream[Work], send: ObjectSendStream[Work]) -> None:
    async with receive, send:
        async for work in receive:
            ctx.enter("apply")
            t0 = time.perf_counter()
            await write(ctx, work)
            ctx.note("apply", 1, work.bucket.staging_bytes, time.perf_counter() - t0)
            await send.send(work)
