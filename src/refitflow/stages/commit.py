"""Commit: credit every verified bucket to coverage; at the end of input, prepare.

A bucket's credits (elements per parameter) were computed with the plan: crediting one is a
constant amount of Python whatever its number of tensors.

Preparing checks that every destination parameter was written exactly once (a fused parameter
counts only when every box of it arrived, whichever buckets they came in; a parameter assembled first —
quantised, or converted from a quantised publication (``stages/_route.py``) — is written here once its
assemblies are complete, and its scales credited as derived) and makes nothing
visible; the pipeline's owner finishes (or, after an engine vote, aborts) it. Before preparing, every
refit stream is drained (``Devices.drain``, off the event loop): a prepared version has no byte in flight.

A relay (``ctx.fanout``) learns each bucket's elements once every digest unit up to that bucket is verified
(``ctx.verified_through``: a unit split over buckets is complete only with its last part), and marks the
tensors they complete as served (``pipeline/relay.py``).
"""

from __future__ import annotations

import time
from typing import Any

import anyio.to_thread
from anyio.abc import ObjectReceiveStream

from refitflow.layouts.boxes import volume
from refitflow.stages._context import StageContext, Work
from refitflow.stages._convert import run_job
from refitflow.stages._route import Job, route_of

__all__ = ["credit", "run"]


def _run(ctx: StageContext, job: Job) -> None:
    """A complete job, on its parameter's refit stream (where its assemblies were made)."""
    with ctx.devices.use((ctx.landing.params[job.param].device,)):
        run_job(ctx.landing, job)


async def credit(ctx: StageContext, work: Work, assembled: dict[str, int]) -> None:
    """Credit one bucket's destination boxes; run each job (``stages/_route.py``) its boxes complete.

    A planned bucket carries its credits (elements per parameter, computed with the plan: O(1) Python
    per bucket); a bucket made outside a plan (the push stream) is credited box by box, so a box that
    arrives twice is caught. ``assembled``: assembly -> elements assembled so far (per attempt).
    """
    assert ctx.attempt is not None  # begun before the first bucket was planned
    b = work.bucket
    if b.credits is not None:
        assert ctx.plan is not None
        ctx.attempt.credit((ctx.plan.serial, b.index), b.credits.params, b.credits.idx, b.credits.counts)
        derived = b.derived
    else:
        for p in b.pieces:
            for s in p.scatters:
                ctx.attempt.record(s.param, s.dbox, volume(s.dbox))
        derived = tuple(s for p in b.pieces for s in p.scatters if s.param in route_of(ctx).assembled)
    route = route_of(ctx) if derived else None
    for s in derived:  # run a job once every element of every assembly it needs arrived (padding excluded)
        assert route is not None
        assembled[s.param] = assembled.get(s.param, 0) + volume(s.dbox)
        job = route.jobs[s.param]
        if any(assembled.get(n, 0) != k for n, k in job.needs):
            continue
        ctx.attempt.mark_written()
        await anyio.to_thread.run_sync(_run, ctx, job)
        if job.param in route.converted:
            ctx.attempt.record(job.param, "derived", ctx.landing.expected[job.param])
        for n in job.quant.derived if job.quant is not None else ():
            ctx.attempt.record(n, "derived", ctx.landing.params[n].numel())


async def run(ctx: StageContext, receive: ObjectReceiveStream[Work]) -> None:
    assembled: dict[str, int] = {}
    owed: list[tuple[int, Any]] = []  # (bucket index, credits) a relay has not served yet
    async with receive:
        async for work in receive:
            ctx.enter("commit")
            t0 = time.perf_counter()
            await credit(ctx, work, assembled)
            if ctx.fanout is not None and work.bucket.credits is not None:
                owed.append((work.bucket.index, work.bucket.credits))
                while owed and owed[0][0] <= ctx.verified_through:
                    ctx.fanout.verified(owed.pop(0)[1])
            ctx.note("commit", 1, work.bucket.nbytes, time.perf_counter() - t0)
    if ctx.attempt is None:
        return  # discovery failed or refused: its error propagates from its own task
    for _, credits in owed:  # every bucket was verified
        assert ctx.fanout is not None
        ctx.fanout.verified(credits)
    t0 = time.perf_counter()
    await ctx.devices.drain()  # nothing still in flight on a device when the version is prepared
    ctx.attempt.prepare()
    ctx.note("commit", 0, 0, time.perf_counter() - t0, item=False)
