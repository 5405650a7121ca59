"""Allocate: lease staging bytes for a bucket from its device's ring of the budgeted arena (waits when full)."""

from __future__ import annotations

import time

from anyio.abc import ObjectReceiveStream, ObjectSendStream

from refitflow.stages._context import StageContext, Work

__all__ = ["run"]


async def run(ctx: StageContext, receive: ObjectReceiveStream[Work], send: ObjectSendStream[Work]) -> None:
    async with receive, send:
        async for work in receive:
            ctx.enter("allocate")
            t0 = time.perf_counter()
            bucket = work.bucket
            if bucket.staging_bytes:
                work.lease = await ctx.staging.allocate(bucket.staging_bytes, bucket.device)
            ctx.note("allocate", 1, bucket.staging_bytes, time.perf_counter() - t0)
            await send.send(work)
