"""Allocate: lease staging bytes for a bucket from its device's ring of the budgeted arena (waits when full)."""

from __future__ import annotations

import time

from anyio.abc import ObjectReceiveStream, ObjectSendStream

from refitflow.refit.attempt import Meter, Resources
from refitflow.refit.work import Work

__all__ = ["run"]


async def run(res: Resources, receive: ObjectReceiveStream[Work], send: ObjectSendStream[Work], meter: Meter) -> None:
    async with receive, send:
        async for work in receive:
            meter.enter()
            t0 = time.perf_counter()
            bucket = work.bucket
            if bucket.staging_bytes:
                work.lease = await res.staging.allocate(bucket.staging_bytes, bucket.device)
            meter.note(1, bucket.staging_bytes, time.perf_counter() - t0)
            await send.send(work)
