"""Verify: check pulled bytes against the publisher's digests where they landed, then release staging.

The plan holds each bucket's checks (``_checks``): the digest units its pieces hold and where their
bytes landed (staging, or the destination for direct pieces), as arrays. Verify hashes them on the
bytes' own device, off the event loop (``_unit_hashes``), and compares with the version's digest vector
(decoded once per refit), by the algorithm the publisher chose for each shard (``core/hashing.py``): a
whole xxh3 unit is one C call; a mix64 piece is one batched torch pass; xxh3 tiles strided where they
landed are gathered. A unit split over pieces (a tile larger than a bucket) is completed across pieces
and buckets (xxh3 streams in plan order; mix64 adds sums). Bytes of units that never complete count as
unverified (possible only under ``verify="pulled"``; under ``"strict"`` the refit then fails).

A version announced before its digests (two-phase publication) is hashed as it lands and each bucket
held here; the digests are asked for beside, and the held buckets compared and sent on, in order, once
they are in: commit sees no bucket whose bytes did not match.

Device work: the hashing runs on the bucket's refit streams (``Devices.use``, in the worker thread),
and the staging lease is freed only after the bucket's marks (apply's copies out of it) are waited for.

Pieces that are not the trainer's own reads get a second chance within their bucket: bytes from an
upstream relay that do not match are read again from the trainer (the relay is not read again), and a
piece a delta refit skipped and re-hashes (``Work.recheck``; staged ones are first gathered back into
staging from where they lie) is read again if it differs (it was changed behind refitflow's back).
Only bytes the trainer itself sent that do not match are an ``IntegrityError``. With every unit of the
buckets so far complete, ``ctx.verified_through`` moves on (relay progress, in commit)."""

from __future__ import annotations

import logging
import time
from collections import Counter

import anyio.to_thread
import numpy as np
from anyio.abc import ObjectReceiveStream, ObjectSendStream

from refitflow.core.errors import IntegrityError
from refitflow.core.gil import off_loop
from refitflow.stages import apply
from refitflow.stages._context import StageContext, Work
from refitflow.stages._delta import PULL
from refitflow.stages._unit_hashes import Compare, HashState, check_bucket
from refitflow.stages.pull import read_pieces
from refitflow.stages.translate import piece_copies

__all__ = ["run"]

log = logging.getLogger(__name__)


def _integrity_error(bad: list[str], version: int | None) -> IntegrityError:
    counts = Counter(bad)
    listed = ", ".join(f"{name!r} ({n} block{'s' if n > 1 else ''})" for name, n in list(counts.items())[:20])
    more = f" and {len(counts) - 20} more" if len(counts) > 20 else ""
    return IntegrityError(
        f"pulled bytes do not match the publisher's digests: {len(bad)} digest block(s) of "
        f"{len(counts)} tensor(s): {listed}{more}",
        tensor=bad[0],
        version=version,
    )


async def _second_chance(ctx: StageContext, work: Work, st: HashState, bad: list[int]) -> None:
    """Read again from the trainer the pieces whose bytes came from a relay or were skipped and re-hashed;
    ``IntegrityError`` if bytes the trainer sent differ (now, or before)."""
    version = ctx.attempt.version if ctx.attempt is not None else None
    relayed = set(work.relayed)
    skipped = set() if work.actions is None else set(np.flatnonzero(work.actions != PULL).tolist())
    pieces = sorted(set(bad))
    if not set(pieces) <= relayed | skipped:
        names = work.bucket.checks.names
        raise _integrity_error([names[k] for k in bad if k not in relayed | skipped], version)
    if relayed & set(pieces):
        assert ctx.upstream is not None
        ctx.upstream.fail("its bytes do not match the trainer's digests")
    again = [k for k in pieces if k in skipped]
    if again:
        log.warning("%d skipped piece(s) of %s changed where they lie (behind refitflow's back): read again",
                    len(again), sorted({work.bucket.pieces[k].tensor for k in again})[:5])  # fmt: skip
    await read_pieces(ctx, work, pieces)
    per = piece_copies(ctx, work) if work.bucket.staged else {}
    work.copies = [c for k in pieces for c in per.get(k, ())]
    await apply.write(ctx, work)  # marks the attempt written
    await ctx.devices.wait(work.marks)
    keep = np.zeros(len(work.bucket.pieces), dtype=bool)
    keep[pieces] = True
    still = (await off_loop(check_bucket, ctx, work, st, keep, [])).bad
    if still:
        names = work.bucket.checks.names
        raise _integrity_error([names[k] for k in still], version)
    size = work.bucket.checks.piece_bytes
    ctx.counts.pulled += int(size[pieces].sum())
    ctx.counts.rerouted += int(size[[k for k in pieces if k in relayed]].sum())
    ctx.counts.repaired += int(size[again].sum())


async def _take_digests(ctx: StageContext) -> None:
    """The version's digest vector; for a version announced before its digests, first the same version
    with them (``stages.discover``: within ``read_timeout_s``) — the reads went on meanwhile."""
    pub = ctx.publication
    assert pub is not None
    if pub.pending:
        pub = ctx.publication = await ctx.complete()
        assert ctx.attempt is not None and ctx.plan is not None
        ctx.attempt.complete(pub.revision)
    assert ctx.plan is not None  # verify follows plan
    ctx.digests = await off_loop(ctx.plan.digests, pub)
    if ctx.attempt is not None:
        ctx.attempt.hold(ctx.plan.digest_geometry, ctx.digests)


def _plan_checks(work: Work) -> tuple[np.ndarray | None, list[int], int]:
    """(pieces to check, staged re-hashed pieces to gather first, pulled bytes) of one bucket."""
    b = work.bucket
    if work.actions is None:
        return None, [], b.nbytes
    pulled = work.actions == PULL
    gather = [k for k in np.flatnonzero(work.recheck).tolist() if not b.pieces[k].direct]
    return pulled | work.recheck, gather, int(b.checks.piece_bytes[pulled].sum())


async def _free(ctx: StageContext, work: Work) -> None:
    await ctx.devices.wait(work.marks)  # apply's copies out of staging are done: it may be reused
    if work.lease is not None:
        ctx.staging.free(work.lease)
        work.lease = None
    work.copies = []


async def run(ctx: StageContext, receive: ObjectReceiveStream[Work], send: ObjectSendStream[Work]) -> None:
    """Check every bucket, then send it on. For a version announced before its digests, each bucket is
    hashed as it lands and held here (its staging freed); the digests are asked for beside
    (``_take_digests``), and the held buckets are compared and sent on, in order, once they are in."""
    st = HashState()
    pulled = 0
    held: list[tuple[Work, Compare, np.ndarray | None, int]] = []
    asked = False  # for the digests (``take``)
    arrived = anyio.Event()

    async def take() -> None:
        await _take_digests(ctx)
        arrived.set()

    async def settled(work: Work, keep: np.ndarray | None, nbytes: int) -> None:
        nonlocal pulled
        ch = work.bucket.checks
        st.verified += ch.whole_bytes if keep is None else int(ch.piece_checked[work.actions == PULL].sum())
        pulled += nbytes
        ctx.unverified_bytes = pulled - st.verified
        if not st.open:
            ctx.verified_through = work.bucket.index
        await send.send(work)

    async def settle_held() -> None:
        assert ctx.digests is not None
        while held:
            work, out, keep, nbytes = held.pop(0)
            bad = out.settle(ctx.digests)
            if bad:  # nothing came from a relay or was skipped: the trainer's bytes differ (IntegrityError)
                await _second_chance(ctx, work, st, bad)
            await settled(work, keep, nbytes)

    try:
        async with receive, send, anyio.create_task_group() as tg:
            async for work in receive:
                ctx.enter("verify")
                t0 = time.perf_counter()
                if ctx.digests is None and not asked:  # the version was announced before its digests
                    asked = True
                    tg.start_soon(take)
                keep, gather, nbytes = _plan_checks(work)
                out = await off_loop(check_bucket, ctx, work, st, keep, gather)
                now = ctx.digests is not None and not held  # compared before staging is freed: a second chance
                if now:  # reads into it
                    bad = out.settle(ctx.digests)
                    if bad:
                        await _second_chance(ctx, work, st, bad)
                await _free(ctx, work)
                ctx.note("verify", 1, nbytes, time.perf_counter() - t0)
                if now:
                    await settled(work, keep, nbytes)
                    continue
                held.append((work, out, keep, nbytes))
                if ctx.digests is not None:
                    await settle_held()
            if held:
                await arrived.wait()
                await settle_held()
            if ctx.limits.verify == "strict" and ctx.unverified_bytes:  # the plan promised whole units only
                raise IntegrityError(  # before commit sees the end of input
                    f"{ctx.unverified_bytes} pulled bytes were not covered by whole digest blocks under "
                    "verify='strict'",
                    version=ctx.attempt.version if ctx.attempt is not None else None,
                )
    except BaseExceptionGroup as group:  # the digests' task failed (or the loop did): its own error
        errors = [e for e in group.exceptions if not isinstance(e, anyio.get_cancelled_exc_class())]
        raise (errors or list(group.exceptions))[0] from None
