"""Commit: credit every verified piece to coverage; at the end of input, prepare the transaction.

Preparing checks that every destination parameter was written exactly once and makes nothing
visible; the pipeline's owner finishes (or, after an engine vote, aborts) it.
"""

from __future__ import annotations

import time

from anyio.abc import ObjectReceiveStream

from refitflow.stages._context import StageContext, Work

__all__ = ["run"]


async def run(ctx: StageContext, receive: ObjectReceiveStream[Work]) -> None:
    async with receive:
        async for work in receive:
            ctx.enter("commit")
            t0 = time.perf_counter()
            assert ctx.attempt is not None  # begun before the first bucket was planned
            for p in work.bucket.pieces:
                ctx.attempt.record(p.param, p.region_key, p.numel)
            ctx.note("commit", 1, work.bucket.nbytes, time.perf_counter() - t0)
    if ctx.attempt is None:
        return  # discovery failed or refused: its error propagates from its own task
    t0 = time.perf_counter()
    ctx.attempt.prepare()
    ctx.note("commit", 0, 0, time.perf_counter() - t0, item=False)
