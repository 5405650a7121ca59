"""What verify hashes, and where: each bucket's digest units on the bytes' own device, compared with the
version's digests at once, or recorded until they arrive (a version announced before its digests).

The plan's ``Checks`` (``planner.checks``) say which units each piece holds and where their bytes landed: whole
contiguous xxh3 units are one C call each (in groups, the GIL let go between them); units split over
pieces stream in plan order across buckets (``HashState.open``); mix64 pieces and strided xxh3 tiles are
computed from their whole box. ``verify`` decides what to do with what differs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import xxhash

from refitflow.core.hashing import hash_ranges, mix64_box_on_device, to_host, xxh3_gathered
from refitflow.core.threads import building, let_go
from refitflow.planner.checks import Checks
from refitflow.refit.attempt import Attempt, Resources
from refitflow.refit.landing import piece_copies
from refitflow.refit.plans import slot
from refitflow.refit.work import Work

__all__ = ["Compare", "HashState", "check_bucket"]

_MASK = (1 << 64) - 1


class Compare:
    """Hashes against the digests: compared at once (``vec``), or recorded until the digests of a version
    announced before them arrive (``vec is None``; ``settle``). ``bad``: the piece of each differing unit."""

    def __init__(self, vec: np.ndarray | None) -> None:
        self.vec = vec
        self.bad: list[int] = []
        self.recorded: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self.recorded_one: list[tuple[int, int, int]] = []

    def __call__(self, want: np.ndarray, got: np.ndarray, names: np.ndarray) -> None:
        if self.vec is None:
            self.recorded.append((want, got, names))
        else:
            self.bad += names[got != self.vec[want]].tolist()

    def one(self, want: int, value: int, name: int) -> None:
        """One unit completed across pieces (no arrays for it)."""
        if self.vec is None:
            self.recorded_one.append((want, value, name))
        elif value != int(self.vec[want]):
            self.bad.append(name)

    def settle(self, vec: np.ndarray) -> list[int]:
        self.vec, recorded, recorded_one = vec, self.recorded, self.recorded_one
        self.recorded, self.recorded_one = [], []
        for want, got, names in recorded:
            self(want, got, names)
        for unit, value, name in recorded_one:
            self.one(unit, value, name)
        return self.bad


@dataclass
class HashState:
    """What verify keeps across the buckets of one refit."""

    open: dict[int, list[Any]] = field(default_factory=dict)  # digest index -> [hasher | sum, bytes so far]
    verified: int = 0  # bytes in whole digest units verified so far
    through: int = -1  # every unit of the buckets up to this index is verified (nothing open after it)


def _buffers(res: Resources, work: Work, ch: Checks, keep: np.ndarray | None = None) -> list[torch.Tensor]:
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
            out.append(res.destination.target_bytes(land.param))
    return out


Views = tuple[list[memoryview], list[memoryview]]  # (each whole unit's bytes, each stream's bytes)


def _views(res: Resources, attempt: Attempt, work: Work, ch: Checks) -> Views | None:
    """The bytes of the whole units and of the streams as memoryviews when they all landed on the CPU, else None;
    cached for the plan's replays like its reads (staging placement is deterministic, shadow targets alternate)."""
    views = attempt.replay.views
    key = slot(work.bucket.index, work.lease, res.destination)
    if key in views:
        return views[key]
    cached = None
    with building():  # once per plan and bucket: one view per unit
        mvs = _memory(res, work, ch)
        if mvs is not None:
            units = [mvs[k][a:b] for k, a, b in zip(ch.land_of.tolist(), ch.lo.tolist(), ch.hi.tolist(), strict=True)]
            cached = units, [mvs[s.land][s.lo : s.hi] for s in ch.streams]
    views[key] = cached
    return cached


def _memory(res: Resources, work: Work, ch: Checks) -> list[memoryview] | None:
    """Each landing's whole buffer as a memoryview, or None when one is not in host memory."""
    out: list[memoryview] = []
    lease: memoryview | None = None
    for land in ch.lands:
        if land.param is not None:
            mv = res.destination.target_memory(land.param)
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


def _whole_units(
    res: Resources, attempt: Attempt, work: Work, ch: Checks, out: Compare, keep: np.ndarray | None
) -> None:
    """Hash the whole contiguous xxh3 units (of the pieces ``keep`` selects)."""
    at = None if keep is None else np.flatnonzero(keep[ch.land_of])
    n = len(ch.want) if at is None else len(at)
    if not n:
        return
    found = _views(res, attempt, work, ch)
    want = ch.want if at is None else ch.want[at]
    if found is not None:
        slices = found[0]
        chosen = slices if at is None else [slices[i] for i in at.tolist()]
        got = _hash_views(chosen)
    else:  # device bytes: through the host bounce buffer, one landing at a time
        bufs = _buffers(res, work, ch, keep)
        land_of, lo, hi = (ch.land_of, ch.lo, ch.hi) if at is None else (ch.land_of[at], ch.lo[at], ch.hi[at])
        got = np.empty(n, dtype=np.uint64)
        for k in np.unique(land_of).tolist():
            sel = land_of == k
            got[sel] = hash_ranges(bufs[k], lo[sel], hi[sel])
    out(want, got, ch.name_of if at is None else ch.name_of[at])


def _complete(st: HashState, want: int, value: int, out: Compare, name: int, total: int) -> None:
    out.one(want, value, name)
    st.verified += total


def _stream_bytes(
    res: Resources, attempt: Attempt, work: Work, ch: Checks, keep: np.ndarray | None
) -> list[memoryview]:
    """Each stream's bytes in host memory: the cached views (``_views``), or device bytes copied to the host."""
    found = _views(res, attempt, work, ch)
    if found is not None:
        return found[1]
    bufs = _buffers(res, work, ch, keep)
    empty = memoryview(b"")
    out = []
    for s in ch.streams:
        data = bufs[s.land][s.lo : s.hi] if keep is None or keep[s.land] else None
        out.append(empty if data is None else (data if data.device.type == "cpu" else data.cpu()).numpy().data)
    return out


def _streams(ch: Checks, views: list[memoryview], st: HashState, out: Compare, keep: np.ndarray | None) -> None:
    """xxh3 units split over pieces (``views``: each one's bytes), fed in order; one entered in the middle is never
    completed."""
    for s, mv in zip(ch.streams, views, strict=True):
        if keep is not None and not keep[s.land]:
            continue
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


def _mixes(ch: Checks, bufs: list[torch.Tensor], st: HashState, out: Compare, keep: np.ndarray | None) -> None:
    """Pieces computed from their whole box: mix64 sums (parts of split tiles add up), gathered xxh3 tiles.

    mix64 runs on the bytes' device, every piece of the bucket before any sum comes back: one copy of the sums
    to the host per device (the weights never leave the device), not a synchronisation per piece."""
    todo = [m for m in ch.mixes if keep is None or keep[m.land]]
    on_device: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
    got: list[np.ndarray | None] = [None] * len(todo)
    for i, m in enumerate(todo):
        land = ch.lands[m.land]
        data = bufs[m.land][land.offset : land.offset + land.nbytes]
        if m.tiling.algo == "mix64":
            on_device.setdefault(data.device, []).append((i, mix64_box_on_device(data, m.tiling, m.box)))
        else:
            got[i] = xxh3_gathered(data, m.tiling, m.box)
    for sums in on_device.values():
        host = to_host(torch.cat([s for _, s in sums]))
        at = 0
        for i, s in sums:
            got[i] = host[at : at + len(s)]
            at += len(s)
    for m, g in zip(todo, got, strict=True):
        assert g is not None  # every piece was hashed above
        whole = m.check & (m.covered == m.total)
        out(m.want[whole], g[whole], np.full(int(whole.sum()), m.name))
        if m.tiling.algo != "mix64":
            continue
        for u in np.flatnonzero(m.check & (m.covered < m.total)).tolist():  # part of a tile: add it up
            want = int(m.want[u])
            state = st.open.setdefault(want, [0, 0])
            state[0] = (state[0] + int(g[u])) & _MASK
            state[1] += int(m.covered[u])
            if state[1] == int(m.total[u]):
                del st.open[want]
                _complete(st, want, state[0], out, m.name, int(m.total[u]))


def check_bucket(res: Resources, attempt: Attempt, work: Work, digests: np.ndarray | None, st: HashState,
                 keep: np.ndarray | None, gather: list[int]) -> Compare:  # fmt: skip
    """Hash the units of the pieces ``keep`` selects (None: all) on the bucket's refit streams (in the worker
    thread), first gathering the staged ``gather`` pieces back from where they lie; compared with the
    ``digests`` if known (``Compare``)."""
    with res.devices.use(work.bucket.devices):
        if gather:
            per = piece_copies(res, work, attempt.plan.route, attempt.replay)
            for k in gather:
                for dst, src in per[k]:
                    src.copy_(dst if dst.shape == src.shape else dst.reshape(src.shape))
        ch = work.bucket.checks
        out = Compare(digests)
        _whole_units(res, attempt, work, ch, out, keep)
        if ch.streams:
            _streams(ch, _stream_bytes(res, attempt, work, ch, keep), st, out, keep)
        if ch.mixes:
            _mixes(ch, _buffers(res, work, ch, keep), st, out, keep)
        return out
