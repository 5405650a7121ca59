"""Pull: issue a bucket's reads through the transport, straight into parameters or into staging.

Which pieces are read, and from where: every piece from its trainer rank, except pieces a delta refit
leaves (``Work.actions``, ``stages/_delta.py``) and pieces an upstream relay holds (``ctx.upstream``,
``stages/_relay.py``). A relay's piece is read only once the relay's status says every tensor it lies
in is verified for this version, and its status is read again after the bytes: if the relay moved on
(its storage may be changing), failed, or made no progress for ``relay_wait_s``, the pieces still
owed are read from the trainer (*rerouted*) and the relay is not read again in this attempt.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Hashable, Sequence

import anyio
import anyio.to_thread
import numpy as np
from anyio.abc import ObjectReceiveStream, ObjectSendStream

from refitflow.core.errors import RefitTimeoutError, TransportError
from refitflow.core.gil import off_loop
from refitflow.stages._context import StageContext, Work
from refitflow.stages._delta import PULL
from refitflow.stages._reads import coalesce, piece_read
from refitflow.stages._relay import RELAY, RelayPiece, Upstream
from refitflow.stages.plan import PlannedRead
from refitflow.transports.base import Read, as_bytes

__all__ = ["read_pieces", "reads_of", "run"]

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
        planned = work.bucket.reads
        cached = await off_loop(_build_reads, ctx, work, planned) if many else _build_reads(ctx, work, planned)
        ctx.plan.read_lists[key] = cached
    return cached


def _build_reads(ctx: StageContext, work: Work, planned: Sequence[PlannedRead]) -> list[Read]:
    assert ctx.publication is not None
    peers = [m.source.agent for m in ctx.publication.manifests]
    up: Upstream | None = ctx.upstream
    out = []
    for r in planned:
        n = r.nbytes * r.count
        if r.param is None:
            assert work.lease is not None
            dst = work.lease.view[r.landing_offset : r.landing_offset + n]
        else:
            dst = ctx.landing.target_bytes(r.param)[r.landing_offset : r.landing_offset + n]
        if r.source == RELAY:
            assert up is not None
            peer, region = up.offer.source.agent, up.offer.params[r.region].region
        else:
            peer, region = peers[r.source], r.region
        out.append(Read(peer, region, r.src_offset, r.nbytes, dst, r.stride, r.count))
    return out


async def _read(ctx: StageContext, work: Work, reads: list[Read], key: Hashable | None, count: bool = True) -> None:
    """Read under ``read_timeout_s``; ``count=False``: reads of a relay (not counted as served, see Transport)."""
    assert ctx.attempt is not None and ctx.transport is not None
    with anyio.move_on_after(ctx.limits.read_timeout_s) as scope:
        try:
            options = {} if count else {"count": False}  # transports written before ``count`` read counted
            await ctx.transport.read(reads, key=key, **options)
        except TransportError as exc:
            if exc.version is not None:
                raise
            raise TransportError(exc.reason, version=ctx.attempt.version, tensor=exc.tensor) from exc
    if scope.cancelled_caught:
        raise RefitTimeoutError(
            f"reads of bucket {work.bucket.index} took longer than {ctx.limits.read_timeout_s} s",
            version=ctx.attempt.version,
        )


async def read_pieces(ctx: StageContext, work: Work, pieces: Sequence[int]) -> None:
    """Read some of a bucket's pieces from their trainer ranks (a reroute, a repair, a partial bucket)."""
    b = work.bucket
    if len(pieces) == len(b.pieces):
        await _read(ctx, work, await reads_of(ctx, work), (ctx.plan.serial, b.index, _lease(work)))
        return
    key = ("some", b.index, _lease(work), ctx.landing.generation % 2)
    picked = np.asarray(pieces, dtype=np.int64).tobytes()
    cached = ctx.plan.derived.get(key)  # the last variant of this bucket: a frozen part repeats refit after refit
    if cached is None or cached[0] != picked:
        planned = coalesce([piece_read(b.pieces[k]) for k in pieces])
        cached = ctx.plan.derived[key] = (picked, _build_reads(ctx, work, planned))
    await _read(ctx, work, cached[1], (ctx.plan.serial, *key, hash(picked)))


def _lease(work: Work) -> int:
    return -1 if work.lease is None else work.lease.offset


async def _status(ctx: StageContext, work: Work, up: Upstream) -> bool:
    """Read the relay's status into its probe: whether its storage still holds or receives this version."""
    assert ctx.attempt is not None
    if not up.status_reads:  # one list object, read again and again: a transport replays what it prepared
        up.status_reads = [Read(up.offer.source.agent, up.offer.status, 0, up.probe.numel() * 8, as_bytes(up.probe))]
    await _read(ctx, work, up.status_reads, ("relay-status", up.offer.source.agent, up.offer.status), count=False)
    up.fresh = True
    return int(up.probe[0]) == ctx.attempt.version


async def _from_relay(ctx: StageContext, work: Work, owed: dict[int, RelayPiece]) -> None:
    """Read ``owed`` pieces from the upstream relay as it verifies them; reroute what it cannot deliver.

    One status read after each batch of pieces both checks that the relay's storage did not begin to change
    while they were read and tells which pieces the next batch (of this bucket or the next) may take."""
    up: Upstream = ctx.upstream
    v = ctx.attempt.version if ctx.attempt is not None else None
    flags = up.probe.numpy()[1:]
    deadline = anyio.current_time() + ctx.limits.relay_wait_s
    delay = 2e-4
    while owed and up.failed is None:
        try:
            ready = [rp for rp in owed.values() if (flags[rp.params] == v).all()] if up.fresh else []
            if not ready:
                if not await _status(ctx, work, up):
                    up.fail(f"it no longer holds version {v}")
                    break
                ready = [rp for rp in owed.values() if (flags[rp.params] == v).all()]
            if ready:
                planned = coalesce([r for rp in ready for r in rp.reads])
                await _read(ctx, work, _build_reads(ctx, work, planned), None, count=False)
                if not await _status(ctx, work, up):  # it moved on while we read: not served bytes
                    up.fail(f"it left version {v} while being read")
                    break
                for rp in ready:
                    del owed[rp.piece]
                    work.relayed.append(rp.piece)
                ctx.counts.relayed += int(work.bucket.checks.piece_bytes[[rp.piece for rp in ready]].sum())
                deadline, delay = anyio.current_time() + ctx.limits.relay_wait_s, 2e-4
                continue
        except (TransportError, RefitTimeoutError) as exc:
            up.fail(f"{type(exc).__name__}: {exc}")
            break
        if anyio.current_time() >= deadline:
            up.fail(f"no progress within relay_wait_s={ctx.limits.relay_wait_s} s")
            break
        up.fresh = False
        await anyio.sleep(delay)
        delay = min(delay * 2, 5e-3)
    if owed:
        await read_pieces(ctx, work, sorted(owed))
        ctx.counts.rerouted += int(work.bucket.checks.piece_bytes[sorted(owed)].sum())


async def _pull(ctx: StageContext, work: Work) -> None:
    b = work.bucket
    pull = range(len(b.pieces)) if work.actions is None else np.flatnonzero(work.actions == PULL).tolist()
    up: Upstream | None = ctx.upstream
    held = up.geometry.buckets[b.index] if up is not None and up.failed is None else {}
    owed = {k: held[k] for k in pull if k in held}
    mine = [k for k in pull if k not in owed]
    if mine:
        await read_pieces(ctx, work, mine)
    if owed:
        await _from_relay(ctx, work, owed)
    ctx.counts.pulled += int(b.checks.piece_bytes[list(pull)].sum()) if len(pull) < len(b.pieces) else b.nbytes


def _writes_directly(work: Work) -> bool:
    """Whether the bucket's reads land straight in destination tensors."""
    if work.actions is None:
        return bool(work.bucket.direct_bytes)
    return any(p.direct and a == PULL for p, a in zip(work.bucket.pieces, work.actions.tolist(), strict=True))


async def run(ctx: StageContext, receive: ObjectReceiveStream[Work], send: ObjectSendStream[Work]) -> None:
    async with receive, send:
        async for work in receive:
            ctx.enter("pull")
            t0 = time.perf_counter()
            assert ctx.attempt is not None and ctx.transport is not None
            if _writes_directly(work):
                ctx.attempt.mark_written()
            t_read = time.perf_counter()
            before = ctx.counts.pulled
            await _pull(ctx, work)
            nbytes = ctx.counts.pulled - before
            ctx.observer.transport_read(ctx.transport.name, nbytes, time.perf_counter() - t_read)
            ctx.note("pull", 1, nbytes, time.perf_counter() - t0)
            await send.send(work)
