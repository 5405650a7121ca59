"""Translate: turn staged source bytes into typed views and pair them with their destinations.

Here a translation is a dtype reinterpretation plus a box of the destination; layout changes
(fused projections, other parallelism) plug in here as data.
"""

from __future__ import annotations

import time

from anyio.abc import ObjectReceiveStream, ObjectSendStream

from refitflow.core.dtypes import dtype_from_name
from refitflow.stages._context import StageContext, Work
from refitflow.stages.plan import piece_view

__all__ = ["run"]


def copies_of(ctx: StageContext, work: Work) -> list:
    out = []
    for p in work.bucket.pieces:
        if p.direct:
            continue
        assert work.lease is not None
        raw = work.lease.view[p.landing_offset : p.landing_offset + p.nbytes]
        src = raw.view(dtype_from_name(p.src_dtype)).view(p.shape)
        out.append((piece_view(ctx.landing.target(p.param), p), src))
    return out


async def run(ctx: StageContext, receive: ObjectReceiveStream[Work], send: ObjectSendStream[Work]) -> None:
    async with receive, send:
        async for work in receive:
            ctx.enter("translate")
            t0 = time.perf_counter()
            work.copies = copies_of(ctx, work)
            ctx.note("translate", 1, work.bucket.staging_bytes, time.perf_counter() - t0)
            await send.send(work)
