"""Commit: credit every verified destination box to coverage; at the end of input, prepare.

Preparing checks that every destination parameter was written exactly once (a fused parameter
counts only when every box of it arrived, whichever buckets they came in; a float8 parameter is
quantised here, once its fp32 assembly is complete, and its scale tensor credited as derived) and makes nothing
visible; the pipeline's owner finishes (or, after an engine vote, aborts) it.
"""

from __future__ import annotations

import time

import anyio.to_thread
from anyio.abc import ObjectReceiveStream

from refitflow.layouts.boxes import volume
from refitflow.stages._context import StageContext, Work
from refitflow.stages._fp8 import quantize_into

__all__ = ["run"]


def _quantize(ctx: StageContext, param: str) -> None:
    scale = ctx.landing.derived[param]
    quantize_into(ctx.landing.release_assembly(param), ctx.landing.target(param), ctx.landing.target(scale))


async def run(ctx: StageContext, receive: ObjectReceiveStream[Work]) -> None:
    assembled: dict[str, int] = {}  # float8 parameter -> elements assembled so far
    async with receive:
        async for work in receive:
            ctx.enter("commit")
            t0 = time.perf_counter()
            assert ctx.attempt is not None  # begun before the first bucket was planned
            for p in work.bucket.pieces:
                for s in p.scatters:
                    ctx.attempt.record(s.param, s.dbox, volume(s.dbox))
                    if s.param not in ctx.landing.derived:
                        continue
                    assembled[s.param] = assembled.get(s.param, 0) + volume(s.dbox)
                    if assembled[s.param] == ctx.landing.expected[s.param]:  # complete: quantise
                        ctx.attempt.mark_written()
                        await anyio.to_thread.run_sync(_quantize, ctx, s.param)
                        scale = ctx.landing.derived[s.param]
                        ctx.attempt.record(scale, "derived", ctx.landing.params[scale].numel())
            ctx.note("commit", 1, work.bucket.nbytes, time.perf_counter() - t0)
    if ctx.attempt is None:
        return  # discovery failed or refused: its error propagates from its own task
    t0 = time.perf_counter()
    ctx.attempt.prepare()
    ctx.note("commit", 0, 0, time.perf_counter() - t0, item=False)
