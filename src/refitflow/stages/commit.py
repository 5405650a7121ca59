"""Commit: credit every verified destination box to coverage; at the end of input, prepare.

Preparing checks that every destination parameter was written exactly once (a fused parameter
counts only when every box of it arrived, whichever buckets they came in) and makes nothing
visible; the pipeline's owner finishes (or, after an engine vote, aborts) it.
"""

from __future__ import annotations

import time

from anyio.abc import ObjectReceiveStream

from refitflow.layouts.boxes import volume
from refitflow.stages._context import StageContext, Work

__all__ = ["run"]


async def run(ctx: StageContext, receive: ObjectReceiveStream[Work]) -> None:
    async with receive:
        async for work in receive:
            ctx.enter("commit")
            t0 = time.perf_counter()
            assert ctx.attempt is not None  # begun before the first bucket was planned
            for p in work.bucket.pieces:
                for s in p.scatters:
                    ctx.attempt.record(s.param, s.dbox, volume(s.dbox))
            ctx.note("commit", 1, work.bucket.nbytes, time.perf_counter() - t0)
    if ctx.attempt is None:
        return  # discovery failed or refused: its error propagates from its own task
    t0 = time.perf_counter()
    ctx.attempt.prepare()
    ctx.note("commit", 0, 0, time.perf_counter() - t0, item=False)
