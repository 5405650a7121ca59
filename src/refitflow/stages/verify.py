"""Verify: check pulled bytes against the publisher's digests where they landed, then release staging.

The plan holds each bucket's checks (``_checks``): the digest units its pieces hold and where their
bytes landed (staging, or the destination for direct pieces), as arrays. Verify hashes them on the
bytes' own device, off the event loop, and compares with the version's digest vector (decoded once
per refit), by the algorithm the publisher chose for each shard (``core/hashing.py``): a whole xxh3
unit is one C call; a mix64 piece is one batched torch pass; xxh3 tiles strided where they landed
are gathered. A unit split over pieces (a tile larger than a bucket) is completed across pieces and
buckets (xxh3 streams in plan order; mix64 adds sums). Bytes of units that never complete count as
unverified (possible only under ``verify="pulled"``; under ``"strict"`` the refit then fails).

Device work: the hashing runs on the bucket's refit streams (``Devices.use``, in the worker thread),
and the staging lease is freed only after the bucket's marks (apply's copies out of it) are waited for.

Pieces that are not the trainer's own reads get a second chance within their bucket: bytes from an
upstream relay that do not match are read again from the trainer (the relay is not read again), and a
piece a delta refit skipped and re-hashes (``Work.recheck``; staged ones are first gathered back into
staging from where they lie) is read again if it differs (it was changed behind refitflow's back).
Only bytes the trainer itself sent that do not match are an ``IntegrityError``. With every unit of the
buckets so far complete, ``ctx.verified_through`` moves on (relay progress, in commit).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import anyio.to_thread
import numpy as np
import torch
import xxhash
from anyio.abc import ObjectReceiveStream, ObjectSendStream

from refitflow.core.errors import IntegrityError
from refitflow.core.gil import building, let_go
from refitflow.core.hashing import hash_ranges, mix64_box, xxh3_gathered
from refitflow.stages import apply
from refitflow.stages._checks import Checks, digest_vector
from refitflow.stages._context import StageContext, Work
from refitflow.stages._delta import PULL
from refitflow.stages.pull import read_pieces
from refitflow.stages.translate import piece_copies

__all__ = ["run"]

_MASK = (1 << 64) - 1
log = logging.getLogger(__name__)


class _Compare:
    """Hashes against the digests: compared at once (``vec``), or recorded until the digests of a version
    announced before them arrive (``vec is None``; ``settle``). ``bad``: the piece of each differing unit."""

    def __init__(self, vec: np.ndarray | None) -> None:
        self.vec = vec
        self.bad: list[int] = []
        self.recorded: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []

    def __call__(self, want: np.ndarray, got: np.ndarray, names: np.ndarray) -> None:
        if self.vec is None:
            self.recorded.append((want, got, names))
        else:
            self.bad += names[got != self.vec[want]].tolist()

    def settle(self, vec: np.ndarray) -> list[int]:
        for want, got, names in self.recorded:
            self.bad += names[got != vec[want]].tolist()
        self.recorded = []
        return self.bad


@dataclass
class _State:
    open: dict[int, list[Any]] = field(default_factory=dict)  # digest index -> [hasher | sum, bytes so far]
    verified: int = 0


def _buffers(ctx: StageContext, work: Work, ch: Checks, keep: np.ndarray | None = None) -> list[torch.Tensor]:
    """Each landing's whole buffer (uint8): the staging lease, or a parameter's target (``keep``: only the
    pieces it selects; the others' entries are empty)."""
    out = []
    for k, land in enumerate(ch.lands):
        if keep is not None and not keep[k]:
            out.append(torch.empty(0, dtype=torch.uint8))
        elif land.param is None:
            assert work.lease is not None
            out.append(work.lease.view)
        else:
            out.append(ctx.landing.target_bytes(land.param))
    return out


def _slices(ctx: StageContext, work: Work, ch: Checks) -> list[memoryview] | None:
    """The whole units' bytes as memoryviews when they all landed on the CPU, else None; cached for the
    plan's replays like its reads (staging placement is deterministic, shadow targets alternate)."""
    key = (work.bucket.index, -1 if work.lease is None else work.lease.offset, ctx.landing.generation % 2)
    if key in ctx.plan.views:
        return ctx.plan.views[key]
    cached = None
    with building():  # once per plan and bucket: one view per unit
        mvs = _memory(ctx, work, ch)
        if mvs is not None:
            cached = [mvs[k][a:b] for k, a, b in zip(ch.land_of.tolist(), ch.lo.tolist(), ch.hi.tolist(), strict=True)]
    ctx.plan.views[key] = cached
    return cached


def _memory(ctx: StageContext, work: Work, ch: Checks) -> list[memoryview] | None:
    """Each landing's whole buffer as a memoryview, or None when one is not in host memory."""
    out: list[memoryview] = []
    lease: memoryview | None = None
    for land in ch.lands:
        if land.param is not None:
            mv = ctx.landing.target_memory(land.param)
        elif lease is not None:
            mv = lease
        else:
            assert work.lease is not None
            view = work.lease.view
            mv = lease = view.numpy().data if view.device.type == "cpu" else None
        if mv is None:
            return None
        out.append(mv)
    return out


_HASH_GROUP = 64  # units per C call: python-xxhash keeps the GIL while it hashes an input under ~100 KB


def _hash_views(views: list[memoryview]) -> np.ndarray:
    """xxh3_64 of each view, a group at a time, the GIL let go between groups: one C loop over a bucket of
    small units kept the GIL for all of it (the event loop's thread waited up to 15 ms)."""
    h, n = xxhash.xxh3_64_intdigest, len(views)
    if n <= _HASH_GROUP:
        return np.fromiter(map(h, views), np.uint64, n)
    out = np.empty(n, dtype=np.uint64)
    for i in range(0, n, _HASH_GROUP):
        part = views[i : i + _HASH_GROUP]
        out[i : i + len(part)] = np.fromiter(map(h, part), np.uint64, len(part))
        let_go()
    return out


def _whole_units(ctx: StageContext, work: Work, ch: Checks, out: _Compare, keep: np.ndarray | None) -> None:
    """Hash the whole contiguous xxh3 units (of the pieces ``keep`` selects)."""
    at = None if keep is None else np.flatnonzero(keep[ch.land_of])
    n = len(ch.want) if at is None else len(at)
    if not n:
        return
    slices = _slices(ctx, work, ch)
    want = ch.want if at is None else ch.want[at]
    if slices is not None:
        chosen = slices if at is None else [slices[i] for i in at.tolist()]
        got = _hash_views(chosen)
    else:  # device bytes: through the host bounce buffer, one landing at a time
        bufs = _buffers(ctx, work, ch, keep)
        land_of, lo, hi = (ch.land_of, ch.lo, ch.hi) if at is None else (ch.land_of[at], ch.lo[at], ch.hi[at])
        got = np.empty(n, dtype=np.uint64)
        for k in np.unique(land_of).tolist():
            sel = land_of == k
            got[sel] = hash_ranges(bufs[k], lo[sel], hi[sel])
    out(want, got, ch.name_of if at is None else ch.name_of[at])


def _complete(st: _State, want: int, value: int, out: _Compare, name: int, total: int) -> None:
    out(np.array([want]), np.array([value], dtype=np.uint64), np.array([name]))
    st.verified += total


def _streams(ch: Checks, bufs: list[torch.Tensor], st: _State, out: _Compare, keep: np.ndarray | None) -> None:
    """xxh3 units split over pieces: fed in order; one entered in the middle is never completed."""
    for s in ch.streams:
        if keep is not None and not keep[s.land]:
            continue
        data = bufs[s.land][s.lo : s.hi]
        mv = (data if data.device.type == "cpu" else data.cpu()).numpy().data
        state = st.open.pop(s.want, None)
        if s.start == 0:
            state = [xxhash.xxh3_64(), 0]
        elif state is None or state[1] != s.start:
            continue
        state[0].update(mv)
        state[1] = s.start + (s.hi - s.lo)
        if state[1] == s.total:
            _complete(st, s.want, state[0].intdigest(), out, s.name, s.total)
        else:
            st.open[s.want] = state


def _mixes(ch: Checks, bufs: list[torch.Tensor], st: _State, out: _Compare, keep: np.ndarray | None) -> None:
    """Pieces computed from their whole box: mix64 sums (parts of split tiles add up), gathered xxh3 tiles."""
    for m in ch.mixes:
        if keep is not None and not keep[m.land]:
            continue
        land = ch.lands[m.land]
        data = bufs[m.land][land.offset : land.offset + land.nbytes]
        mix = m.tiling.algo == "mix64"
        got = mix64_box(data, m.tiling, m.box) if mix else xxh3_gathered(data, m.tiling, m.box)
        whole = m.check & (m.covered == m.total)
        out(m.want[whole], got[whole], np.full(int(whole.sum()), m.name))
        if not mix:
            continue
        for u in np.flatnonzero(m.check & (m.covered < m.total)).tolist():  # part of a tile: add it up
            want = int(m.want[u])
            state = st.open.setdefault(want, [0, 0])
            state[0] = (state[0] + int(got[u])) & _MASK
            state[1] += int(m.covered[u])
            if state[1] == int(m.total[u]):
                del st.open[want]
                _complete(st, want, state[0], out, m.name, int(m.total[u]))


def _check_bucket(ctx: StageContext, work: Work, st: _State, keep: np.ndarray | None,
                  gather: list[int]) -> _Compare:  # fmt: skip
    """Hash the units of the pieces ``keep`` selects (None: all) on the bucket's refit streams (in the worker
    thread), first gathering the staged ``gather`` pieces back from where they lie; compared with the
    digests if known (``_Compare``)."""
    with ctx.devices.use(work.bucket.devices):
        if gather:
            per = piece_copies(ctx, work)
            for k in gather:
                for dst, src in per[k]:
                    src.copy_(dst if dst.shape == src.shape else dst.reshape(src.shape))
        return _check_units(ctx, work, st, keep)


def _check_units(ctx: StageContext, work: Work, st: _State, keep: np.ndarray | None) -> _Compare:
    ch: Checks = work.bucket.checks
    out = _Compare(ctx.digests)
    _whole_units(ctx, work, ch, out, keep)
    if ch.streams or ch.mixes:
        bufs = _buffers(ctx, work, ch, keep)
        _streams(ch, bufs, st, out, keep)
        _mixes(ch, bufs, st, out, keep)
    return out


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


async def _second_chance(ctx: StageContext, work: Work, st: _State, bad: list[int]) -> None:
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
    still = (await anyio.to_thread.run_sync(_check_bucket, ctx, work, st, keep, [])).bad
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
    ctx.digests = await anyio.to_thread.run_sync(digest_vector, pub)
    if ctx.attempt is not None and ctx.plan is not None:
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
    st = _State()
    pulled = 0
    held: list[tuple[Work, _Compare, np.ndarray | None, int]] = []
    early: bool | None = None  # the version was announced before its digests
    arrived = anyio.Event()

    async def take() -> None:
        await _take_digests(ctx)
        arrived.set()

    async def settled(work: Work, out: _Compare, keep: np.ndarray | None, nbytes: int) -> None:
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
            await settled(work, out, keep, nbytes)

    try:
        async with receive, send, anyio.create_task_group() as tg:
            async for work in receive:
                ctx.enter("verify")
                t0 = time.perf_counter()
                if ctx.digests is None and early is None:
                    assert ctx.publication is not None
                    early = ctx.publication.pending
                    if early:
                        tg.start_soon(take)
                    else:  # a plan that did not decode them
                        await _take_digests(ctx)
                keep, gather, nbytes = _plan_checks(work)
                out = await anyio.to_thread.run_sync(_check_bucket, ctx, work, st, keep, gather)
                if ctx.digests is not None and not held:  # compared at once (a second chance reads into staging)
                    bad = out.settle(ctx.digests)
                    if bad:
                        await _second_chance(ctx, work, st, bad)
                    await _free(ctx, work)
                    ctx.note("verify", 1, nbytes, time.perf_counter() - t0)
                    await settled(work, out, keep, nbytes)
                    continue
                await _free(ctx, work)
                ctx.note("verify", 1, nbytes, time.perf_counter() - t0)
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
