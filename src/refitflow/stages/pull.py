"""Pull: issue a bucket's reads through the transport, straight into parameters or into staging."""

from __future__ import annotations

import logging
import time
from collections.abc import Hashable

import anyio
import anyio.to_thread
import torch
from anyio.abc import ObjectReceiveStream, ObjectSendStream

from refitflow.core.errors import RefitTimeoutError, TransportError
from refitflow.stages._context import StageContext, Work
from refitflow.stages._reroute import Rerouter
from refitflow.transports.base import Read, as_bytes

__all__ = ["run"]

log = logging.getLogger(__name__)


async def reads_of(ctx: StageContext, work: Work) -> list[Read]:
    """The bucket's reads; for a cached plan the same list object as last time its targets were the same.

    Staging placement is deterministic and shadow targets alternate between two storages, so a
    (bucket, lease offset, destination generation) replays the very same reads, and a transport can
    recognise the list and skip describing it again. A new list is built off the event loop.
    """
    key = (work.bucket.index, -1 if work.lease is None else work.lease.offset, ctx.landing.generation % 2)
    cached = ctx.plan.read_lists.get(key)
    if cached is None:
        many = len(work.bucket.reads) > 64
        cached = await anyio.to_thread.run_sync(_build_reads, ctx, work) if many else _build_reads(ctx, work)
        ctx.plan.read_lists[key] = cached
    return cached


def _build_reads(ctx: StageContext, work: Work) -> list[Read]:
    assert ctx.publication is not None
    peers = [m.source.agent for m in ctx.publication.sources]
    out = []
    targets: dict[str, torch.Tensor] = {}
    for r in work.bucket.reads:
        n = r.nbytes * r.count
        if r.param is None:
            assert work.lease is not None
            dst = work.lease.view[r.landing_offset : r.landing_offset + n]
        else:
            whole = targets.get(r.param)
            if whole is None:
                whole = targets[r.param] = as_bytes(ctx.landing.target(r.param))
            dst = whole[r.landing_offset : r.landing_offset + n]
        out.append(Read(peers[r.source], r.region, r.src_offset, r.nbytes, dst, r.stride, r.count))
    return out


async def _read(ctx: StageContext, work: Work, reads: list[Read], key: Hashable | None) -> None:
    assert ctx.attempt is not None and ctx.transport is not None
    with anyio.move_on_after(ctx.limits.read_timeout_s) as scope:
        try:
            await ctx.transport.read(reads, key=key)
        except TransportError as exc:
            if exc.version is not None:
                raise
            raise TransportError(exc.reason, version=ctx.attempt.version, tensor=exc.tensor) from exc
    if scope.cancelled_caught:
        raise RefitTimeoutError(
            f"reads of bucket {work.bucket.index} took longer than {ctx.limits.read_timeout_s} s",
            version=ctx.attempt.version,
        )


async def _read_with_replicas(ctx: StageContext, work: Work, reads: list[Read], key: Hashable | None) -> None:
    """Read; if that fails, read each source's part on its own, moving a failing replica's to the trainer."""
    assert ctx.publication is not None
    if ctx.reroute is None or ctx.reroute.replicas.keys() != {m.source.agent for m in ctx.publication.replicas}:
        ctx.reroute = Rerouter(ctx.publication)
    rr = ctx.reroute
    if rr.avoid:
        reads, key = rr.avoiding(reads), None
    try:
        await _read(ctx, work, reads, key)
        return
    except (TransportError, RefitTimeoutError):
        if not any(rr.is_replica(r) for r in reads):
            raise
    by_peer: dict[str, list[Read]] = {}
    for r in reads:
        by_peer.setdefault(r.peer, []).append(r)
    for peer, group in by_peer.items():
        try:
            await _read(ctx, work, group, None)
        except (TransportError, RefitTimeoutError):
            if peer not in rr.replicas:
                raise
            log.warning("replica source %s failed: reading its bytes from the trainer", peer)
            rr.avoid.add(peer)
            await _read(ctx, work, [rr.to_trainer(r) for r in group], None)


async def run(ctx: StageContext, receive: ObjectReceiveStream[Work], send: ObjectSendStream[Work]) -> None:
    async with receive, send:
        async for work in receive:
            ctx.enter("pull")
            t0 = time.perf_counter()
            assert ctx.attempt is not None and ctx.transport is not None
            if work.bucket.direct_bytes:
                ctx.attempt.mark_written()
            # the same plan's bucket replays the same ranges (staging placement is deterministic);
            # the key is a hint: a transport re-checks addresses before replaying prepared descriptors
            key = (ctx.plan.serial, work.bucket.index, -1 if work.lease is None else work.lease.offset)
            t_read = time.perf_counter()
            reads = await reads_of(ctx, work)
            if ctx.publication is not None and ctx.publication.replicas:
                await _read_with_replicas(ctx, work, reads, key)
            else:
                await _read(ctx, work, reads, key)
            ctx.observer.transport_read(ctx.transport.name, work.bucket.nbytes, time.perf_counter() - t_read)
            ctx.note("pull", 1, work.bucket.nbytes, time.perf_counter() - t0)
            await send.send(work)
