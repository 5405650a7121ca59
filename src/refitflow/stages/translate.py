"""Translate: turn staged source bytes into typed boxes and pair each with its destination box.

A staged piece holds its source box row-major; each of its scatters is a sub-box of it that lands
in a box of a destination parameter (a slice of a fused parameter, another TP slice, another rank
of leading dimensions). Layout knowledge is already in the plan's boxes: nothing here is per model.
Only views are made here; the device work (copies, casts) is apply's.
"""

from __future__ import annotations

import time

import numpy as np
from anyio.abc import ObjectReceiveStream, ObjectSendStream

from refitflow.core.dtypes import dtype_from_name
from refitflow.core.gil import off_loop
from refitflow.stages._context import StageContext, Work
from refitflow.stages._delta import COPY, PULL
from refitflow.stages._route import route_of
from refitflow.stages.plan import box_index

__all__ = ["copies_of", "piece_copies", "run"]


def copies_of(ctx: StageContext, work: Work) -> list:
    """(destination view, staged view) pairs of the bucket; for a replayed plan the same list as last time
    (staging placement is deterministic, shadow targets alternate), except around float8 assembly buffers
    (made anew for every version) and for buckets made outside a plan (the push stream).

    A delta refit (``work.actions``) copies only the pieces it pulls, and copies the pieces it takes from the
    live storage (``COPY``) there, scatter by scatter."""
    if work.actions is not None:
        per = piece_copies(ctx, work)
        assembled = tuple(p for k, p in enumerate(work.bucket.pieces) if not p.direct and k not in per)  # assemblies
        out = [c for k, a in enumerate(work.actions.tolist()) if a == PULL for c in per.get(k, ())]
        return out + _copies(ctx, work, assembled) + _from_live(ctx, work)
    if work.bucket.derived or ctx.plan is None:
        return _copies(ctx, work)
    cached = ctx.plan.read_lists.get(_key(ctx, work))
    if cached is None:
        cached = ctx.plan.read_lists[_key(ctx, work)] = _copies(ctx, work)
    return cached


def piece_copies(ctx: StageContext, work: Work) -> dict[int, list]:
    """The copies of each staged piece (by its index in the bucket) but those into assemblies (made anew for
    every version; such pieces are never skipped or relayed), cached like ``copies_of``."""
    key = ("pieces", *_key(ctx, work)[1:])
    cached = ctx.plan.read_lists.get(key)
    if cached is None:
        assembled = ctx.plan.route.assembled
        cached = ctx.plan.read_lists[key] = {
            k: _copies(ctx, work, (p,))
            for k, p in enumerate(work.bucket.pieces)
            if not p.direct and not any(s.param in assembled for s in p.scatters)
        }
    return cached


def _from_live(ctx: StageContext, work: Work) -> list:
    """Copies of the ``COPY`` pieces' boxes from the live storage into the target (shadow delta refits)."""
    out = []
    for k in np.flatnonzero(work.actions == COPY).tolist():
        for s in work.bucket.pieces[k].scatters:
            at = box_index(s.dbox)
            out.append((ctx.landing.target(s.param)[at], ctx.landing.live(s.param)[at]))
    return out


def _key(ctx: StageContext, work: Work) -> tuple:
    return ("copies", work.bucket.index, -1 if work.lease is None else work.lease.offset, ctx.landing.generation % 2)


def _copies(ctx: StageContext, work: Work, pieces: tuple | None = None) -> list:
    out = []
    route = route_of(ctx)
    with ctx.devices.use(work.bucket.devices):  # assembly buffers belong to the refit streams
        for p in work.bucket.staged if pieces is None else pieces:
            assert work.lease is not None
            raw = work.lease.view[p.landing_offset : p.landing_offset + p.nbytes]
            dtype = dtype_from_name(p.src_dtype)
            if raw.storage_offset() % dtype.itemsize:  # packed after an odd-sized entry (a stream): realign it
                raw = raw.clone()
            staged = raw.view(dtype).view(p.shape)
            for s in p.scatters:
                rel = tuple((a - o, b - o) for (a, b), (o, _) in zip(s.sub, p.box, strict=True))
                if s.param in route.assembled:
                    whole = ctx.landing.assembly(s.param, route.aux.get(s.param))
                else:
                    whole = ctx.landing.target(s.param)
                out.append((whole[box_index(s.dbox)], staged[box_index(rel)]))  # apply reshapes, on the device
    return out


async def run(ctx: StageContext, receive: ObjectReceiveStream[Work], send: ObjectSendStream[Work]) -> None:
    async with receive, send:
        async for work in receive:
            ctx.enter("translate")
            t0 = time.perf_counter()
            staged = work.bucket.staged
            if len(staged) > 64 and _key(ctx, work) not in ctx.plan.read_lists:  # many new views: off the loop
                work.copies = await off_loop(copies_of, ctx, work)
            else:
                work.copies = copies_of(ctx, work) if staged or work.actions is not None else []
            ctx.note("translate", 1, work.bucket.staging_bytes, time.perf_counter() - t0)
            await send.send(work)
