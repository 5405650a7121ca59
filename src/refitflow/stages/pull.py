"""Pull: issue a bucket's reads through the transport, straight into parameters or into staging."""

from __future__ import annotations

import time

import anyio
from anyio.abc import ObjectReceiveStream, ObjectSendStream

from refitflow.core.errors import RefitTimeoutError, TransportError
from refitflow.stages._context import StageContext, Work
from refitflow.transports.base import Read, as_bytes

__all__ = ["run"]


def reads_of(ctx: StageContext, work: Work) -> list[Read]:
    """The bucket's reads; for a cached plan the same list object as last time its targets were the same.

    Staging placement is deterministic and shadow targets alternate between two storages, so a
    (bucket, lease offset, destination generation) replays the very same reads, and a transport can
    recognise the list and skip describing it again.
    """
    key = (work.bucket.index, -1 if work.lease is None else work.lease.offset, ctx.landing.generation % 2)
    cached = ctx.plan.read_lists.get(key)
    if cached is None:
        cached = ctx.plan.read_lists[key] = _build_reads(ctx, work)
    return cached


def _build_reads(ctx: StageContext, work: Work) -> list[Read]:
    assert ctx.publication is not None
    peers = [m.source.agent for m in ctx.publication.manifests]
    out = []
    for r in work.bucket.reads:
        if r.param is None:
            assert work.lease is not None
            dst = work.lease.view[r.landing_offset : r.landing_offset + r.nbytes]
        else:
            dst = as_bytes(ctx.landing.target(r.param))[r.landing_offset : r.landing_offset + r.nbytes]
        out.append(Read(peers[r.source], r.region, r.src_offset, r.nbytes, dst))
    return out


async def run(ctx: StageContext, receive: ObjectReceiveStream[Work], send: ObjectSendStream[Work]) -> None:
    async with receive, send:
        async for work in receive:
            ctx.enter("pull")
            t0 = time.perf_counter()
            assert ctx.attempt is not None
            if work.bucket.direct_bytes:
                ctx.attempt.mark_written()
            # the same plan's bucket replays the same ranges (staging placement is deterministic);
            # the key is a hint: a transport re-checks addresses before replaying prepared descriptors
            key = (ctx.plan.serial, work.bucket.index, -1 if work.lease is None else work.lease.offset)
            t_read = time.perf_counter()
            with anyio.move_on_after(ctx.limits.read_timeout_s) as scope:
                try:
                    await ctx.transport.read(reads_of(ctx, work), key=key)
                except TransportError as exc:
                    if exc.version is not None:
                        raise
                    raise TransportError(exc.reason, version=ctx.attempt.version, tensor=exc.tensor) from exc
            if scope.cancelled_caught:
                raise RefitTimeoutError(
                    f"reads of bucket {work.bucket.index} took longer than {ctx.limits.read_timeout_s} s",
                    version=ctx.attempt.version,
                )
            ctx.observer.transport_read(ctx.transport.name, work.bucket.nbytes, time.perf_counter() - t_read)
            ctx.note("pull", 1, work.bucket.nbytes, time.perf_counter() - t0)
            await send.send(work)
