"""Allocate: lease staging bytes for a bucket from its device's ring of the budgeted arena (waits when full)."""

from __future__ import annotations

import time

from refitflow.refit.attempt import Meter, Resources
from refitflow.refit.handoff import give, take
from refitflow.refit.work import Receive, Send

__all__ = ["run"]


async def run(res: Resources, receive: Receive, send: Send, meter: Meter) -> None:
    async with receive, send:
        while (work := await take(receive)) is not None:
            meter.enter()
            t0 = time.perf_counter()
            bucket = work.bucket
            if bucket.staging_bytes:
                work.lease = await res.staging.allocate(bucket.staging_bytes, bucket.device)
            meter.note(1, bucket.staging_bytes, time.perf_counter() - t0)
            await give(send, work)
