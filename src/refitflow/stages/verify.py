"""Verify: check pulled bytes against the publisher's digests where they landed, then release staging.

The plan holds each bucket's checks (``_checks``): the digest units its pieces hold and where their
bytes landed (staging, or the destination for direct pieces), as arrays. Verify hashes them on the
bytes' own device, off the event loop, and compares with the version's digest vector (decoded once
per refit), by the algorithm the publisher chose for each shard (``core/digests.py``): a whole xxh3
unit is one C call; a mix64 piece is one batched torch pass; xxh3 tiles strided where they landed
are gathered. A unit split over pieces (a tile larger than a bucket) is completed across pieces and
buckets (xxh3 streams in plan order; mix64 adds sums). Bytes of units that never complete count as
unverified (possible only under ``verify="pulled"``; under ``"strict"`` the refit then fails).

Device work: the hashing runs on the bucket's refit streams (``Devices.use``, in the worker thread),
and the staging lease is freed only after the bucket's marks (apply's copies out of it) are waited for.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import anyio.to_thread
import numpy as np
import torch
import xxhash
from anyio.abc import ObjectReceiveStream, ObjectSendStream

from refitflow.core.digests import hash_ranges, mix64_box, xxh3_gathered
from refitflow.core.errors import IntegrityError
from refitflow.stages._checks import Checks, digest_vector
from refitflow.stages._context import StageContext, Work
from refitflow.transports.base import as_bytes

__all__ = ["run"]

_MASK = (1 << 64) - 1


@dataclass
class _State:
    vec: np.ndarray | None = None  # the version's digests
    open: dict[int, list[Any]] = field(default_factory=dict)  # digest index -> [hasher | sum, bytes so far]
    verified: int = 0


def _buffers(ctx: StageContext, work: Work, ch: Checks) -> list[torch.Tensor]:
    """Each landing's whole buffer (uint8): the staging lease, or a parameter's target."""
    out = []
    for land in ch.lands:
        if land.param is None:
            assert work.lease is not None
            out.append(work.lease.view)
        else:
            out.append(as_bytes(ctx.landing.target(land.param)))
    return out


def _slices(ctx: StageContext, work: Work, ch: Checks) -> list[memoryview] | None:
    """The whole units' bytes as memoryviews when they all landed on the CPU, else None; cached for the
    plan's replays like its reads (staging placement is deterministic, shadow targets alternate)."""
    key = (work.bucket.index, -1 if work.lease is None else work.lease.offset, ctx.landing.generation % 2)
    if key in ctx.plan.views:
        return ctx.plan.views[key]
    bufs = _buffers(ctx, work, ch)
    cached = None
    if all(b.device.type == "cpu" for b in bufs):
        mvs = [b.numpy().data for b in bufs]
        cached = [mvs[k][a:b] for k, a, b in zip(ch.land_of.tolist(), ch.lo.tolist(), ch.hi.tolist(), strict=True)]
    ctx.plan.views[key] = cached
    return cached


def _whole_units(ctx: StageContext, work: Work, ch: Checks, vec: np.ndarray) -> list[int]:
    """Hash the whole contiguous xxh3 units; the names (indices) of those that differ."""
    if not len(ch.want):
        return []
    slices = _slices(ctx, work, ch)
    if slices is not None:
        got = np.fromiter(map(xxhash.xxh3_64_intdigest, slices), np.uint64, len(ch.want))
    else:  # device bytes: through the host bounce buffer, one landing at a time
        bufs = _buffers(ctx, work, ch)
        got = np.empty(len(ch.want), dtype=np.uint64)
        for k in np.unique(ch.land_of).tolist():
            sel = ch.land_of == k
            got[sel] = hash_ranges(bufs[k], ch.lo[sel], ch.hi[sel])
    return ch.name_of[got != vec[ch.want]].tolist()


def _complete(st: _State, want: int, value: int, vec: np.ndarray, name: int, bad: list[int], total: int) -> None:
    if value != int(vec[want]):
        bad.append(name)
    st.verified += total


def _streams(ch: Checks, bufs: list[torch.Tensor], st: _State, vec: np.ndarray, bad: list[int]) -> None:
    """xxh3 units split over pieces: fed in order; one entered in the middle is never completed."""
    for s in ch.streams:
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


def _mixes(ch: Checks, bufs: list[torch.Tensor], st: _State, vec: np.ndarray, bad: list[int]) -> None:
    """Pieces computed from their whole box: mix64 sums (parts of split tiles add up), gathered xxh3 tiles."""
    for m in ch.mixes:
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


def _check_bucket(ctx: StageContext, work: Work, st: _State) -> list[str]:
    """Hash the bucket's units on its refit streams (in the worker thread); the tensor of every unit
    that differs (one entry per unit)."""
    with ctx.devices.use(work.bucket.devices):
        return _check_units(ctx, work, st)


def _check_units(ctx: StageContext, work: Work, st: _State) -> list[str]:
    ch: Checks = work.bucket.checks
    if st.vec is None:  # once per refit, in the worker thread
        assert ctx.publication is not None
        st.vec = digest_vector(ctx.publication)
    vec = st.vec
    bad = _whole_units(ctx, work, ch, vec)
    if ch.streams or ch.mixes:
        bufs = _buffers(ctx, work, ch)
        _streams(ch, bufs, st, vec, bad)
        _mixes(ch, bufs, st, vec, bad)
    st.verified += ch.whole_bytes
    return [ch.names[i] for i in bad]


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


async def run(ctx: StageContext, receive: ObjectReceiveStream[Work], send: ObjectSendStream[Work]) -> None:
    st = _State()
    pulled = 0
    async with receive, send:
        async for work in receive:
            ctx.enter("verify")
            t0 = time.perf_counter()
            bad = await anyio.to_thread.run_sync(_check_bucket, ctx, work, st)
            if bad:
                raise _integrity_error(bad, ctx.attempt.version if ctx.attempt is not None else None)
            await ctx.devices.wait(work.marks)  # apply's copies out of staging are done: it may be reused
            if work.lease is not None:
                ctx.staging.free(work.lease)
                work.lease = None
            work.copies = []
            pulled += work.bucket.nbytes
            ctx.unverified_bytes = pulled - st.verified
            ctx.note("verify", 1, work.bucket.nbytes, time.perf_counter() - t0)
            await send.send(work)
    if ctx.limits.verify == "strict" and ctx.unverified_bytes:  # the plan promised whole units only
        raise IntegrityError(
            f"{ctx.unverified_bytes} pulled bytes were not covered by whole digest blocks under verify='strict'",
            version=ctx.attempt.version if ctx.attempt is not None else None,
        )
