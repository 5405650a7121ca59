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


def _whole_units(ctx: StageContext, work: Work, ch: Checks, vec: np.ndarray, keep: np.ndarray | None) -> list[int]:
    """Hash the whole contiguous xxh3 units (of the pieces ``keep`` selects); the pieces of those that differ."""
    at = None if keep is None else np.flatnonzero(keep[ch.land_of])
    n = len(ch.want) if at is None else len(at)
    if not n:
        return []
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
    names = ch.name_of if at is None else ch.name_of[at]
    return names[got != vec[want]].tolist()


def _complete(st: _State, want: int, value: int, vec: np.ndarray, name: int, bad: list[int], total: int) -> None:
    if value != int(vec[want]):
        bad.append(name)
    st.verified += total


def _streams(ch: Checks, bufs: list[torch.Tensor], st: _State, vec: np.ndarray, bad: list[int],
             keep: np.ndarray | None) -> None:  # fmt: skip
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
            _complete(st, s.want, state[0].intdigest(), vec, s.name, bad, s.total)
        else:
            st.open[s.want] = state


def _mixes(ch: Checks, bufs: list[torch.Tensor], st: _State, vec: np.ndarray, bad: list[int],
            keep: np.ndarray | None) -> None:  # fmt: skip
    """Pieces computed from their whole box: mix64 sums (parts of split tiles add up), gathered xxh3 tiles."""
    for m in ch.mixes:
        if keep is not None and not keep[m.land]:
            continue
        land = ch.lands[m.land]
        data = bufs[m.land][land.offset : land.offset + land.nbytes]
        mix = m.tiling.algo == "mix64"
        got = mix64_box(data, m.tiling, m.box) if mix else xxh3_gathered(data, m.tiling, m.box)
        whole = m.check & (m.covered == m.total)
        differ = got[whole] != vec[m.want[whole]]
        bad += [m.name] * int(differ.sum())
        if not mix:
            continue
        for u in np.flatnonzero(m.check & (m.covered < m.total)).tolist():  # part of a tile: add it up
            want = int(m.want[u])
            state = st.open.setdefault(want, [0, 0])
            state[0] = (state[0] + int(got[u])) & _MASK
            state[1] += int(m.covered[u])
            if state[1] == int(m.total[u]):
                del st.open[want]
                _complete(st, want, state[0], vec, m.name, bad, int(m.total[u]))


def _check_bucket(ctx: StageContext, work: Work, st: _State, keep: np.ndarray | None,
                  gather: list[int]) -> list[int]:  # fmt: skip
    """Hash the units of the pieces ``keep`` selects (None: all) on the bucket's refit streams (in the worker
    thread), first gathering the staged ``gather`` pieces back from where they lie; the piece of every unit
    that differs (one entry per unit)."""
    with ctx.devices.use(work.bucket.devices):
        if gather:
            per = piece_copies(ctx, work)
            for k in gather:
                for dst, src in per[k]:
                    src.copy_(dst if dst.shape == src.shape else dst.reshape(src.shape))
        return _check_units(ctx, work, st, keep)


def _check_units(ctx: StageContext, work: Work, st: _State, keep: np.ndarray | None) -> list[int]:
    ch: Checks = work.bucket.checks
    vec = ctx.digests
    bad = _whole_units(ctx, work, ch, vec, keep)
    if ch.streams or ch.mixes:
        bufs = _buffers(ctx, work, ch, keep)
        _streams(ch, bufs, st, vec, bad, keep)
        _mixes(ch, bufs, st, vec, bad, keep)
    return bad


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
    still = await anyio.to_thread.run_sync(_check_bucket, ctx, work, st, keep, [])
    if still:
        names = work.bucket.checks.names
        raise _integrity_error([names[k] for k in still], version)
    size = work.bucket.checks.piece_bytes
    ctx.counts.pulled += int(size[pieces].sum())
    ctx.counts.rerouted += int(size[[k for k in pieces if k in relayed]].sum())
    ctx.counts.repaired += int(size[again].sum())


def _plan_checks(work: Work) -> tuple[np.ndarray | None, list[int], int]:
    """(pieces to check, staged re-hashed pieces to gather first, pulled bytes) of one bucket."""
    b = work.bucket
    if work.actions is None:
        return None, [], b.nbytes
    pulled = work.actions == PULL
    gather = [k for k in np.flatnonzero(work.recheck).tolist() if not b.pieces[k].direct]
    return pulled | work.recheck, gather, int(b.checks.piece_bytes[pulled].sum())


async def run(ctx: StageContext, receive: ObjectReceiveStream[Work], send: ObjectSendStream[Work]) -> None:
    st = _State()
    pulled = 0
    async with receive, send:
        async for work in receive:
            ctx.enter("verify")
            t0 = time.perf_counter()
            if ctx.digests is None:  # a plan that did not decode them (the push stream never gets here)
                assert ctx.publication is not None
                ctx.digests = await anyio.to_thread.run_sync(digest_vector, ctx.publication)
            keep, gather, nbytes = _plan_checks(work)
            bad = await anyio.to_thread.run_sync(_check_bucket, ctx, work, st, keep, gather)
            if bad:
                await _second_chance(ctx, work, st, bad)
            await ctx.devices.wait(work.marks)  # apply's copies out of staging are done: it may be reused
            if work.lease is not None:
                ctx.staging.free(work.lease)
                work.lease = None
            work.copies = []
            ch = work.bucket.checks
            st.verified += ch.whole_bytes if keep is None else int(ch.piece_checked[work.actions == PULL].sum())
            pulled += nbytes
            ctx.unverified_bytes = pulled - st.verified
            if not st.open:
                ctx.verified_through = work.bucket.index
            ctx.note("verify", 1, nbytes, time.perf_counter() - t0)
            await send.send(work)
        if ctx.limits.verify == "strict" and ctx.unverified_bytes:  # the plan promised whole units only
            raise IntegrityError(  # before commit sees the end of input
                f"{ctx.unverified_bytes} pulled bytes were not covered by whole digest blocks under verify='strict'",
                version=ctx.attempt.version if ctx.attempt is not None else None,
            )
