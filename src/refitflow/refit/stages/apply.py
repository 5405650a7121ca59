"""Apply: copy (and cast) translated staging views into their destinations, off the event loop.

The copies are issued on the refit streams of the bucket's devices (``DeviceLane.use``) and marked
(``DeviceLane.record``): on CUDA they may still run when apply passes the bucket on; verify waits for
the marks before the staging they read is freed, and commit drains every stream before prepare.
"""

from __future__ import annotations

import time

from refitflow.refit.attempt import Attempt, Meter, Resources
from refitflow.refit.handoff import give, take
from refitflow.refit.landing import write
from refitflow.refit.work import Receive, Send

__all__ = ["run"]


async def run(
    res: Resources, attempt: Attempt, receive: Receive, send: Send, meter: Meter
) -> None:
    async with receive, send:
        while (work := await take(receive)) is not None:
            meter.enter()
            t0 = time.perf_counter()
            await write(res, attempt.txn, work)
            meter.note(1, work.bucket.staging_bytes, time.perf_counter() - t0)
            await give(send, work)
