"""What verify and commit need for one bucket, computed once when the plan is built.

A plan is replayed for every version with the same layout, so everything that depends only on the
layout is decided here, not per refit: which digest units each piece holds (``core.digests.units_of``)
and where their bytes land, as arrays; the index of each unit's digest in the version's digest
vector (the digests of the shards the plan reads, in the order it reads them: ``DigestIndex``,
``digest_vector``); and the elements each bucket credits to each parameter. Verify then hashes and
compares arrays; commit adds arrays.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
import orjson
import xxhash

from refitflow.core.digests import Tiling, Units, units_array
from refitflow.core.threads import breathe
from refitflow.core.types import TILING_KEY, Manifest, Publication
from refitflow.layouts.boxes import Box, volume
from refitflow.planner.vector import PLACE, DigestRuns

__all__ = [
    "Checks",
    "Credits",
    "DigestIndex",
    "Land",
    "Mix",
    "Stream",
    "build_checks",
    "build_credits",
    "used_digests",
]  # fmt: skip



@dataclass(slots=True, unsafe_hash=True)  # a plan record: see planner/records.py
class Land:
    """Where a piece's bytes are after pull: a parameter's target (direct) or the bucket's staging."""

    param: str | None  # None: the staging lease
    offset: int  # byte offset of the piece in that buffer
    nbytes: int


@dataclass(frozen=True, slots=True)
class Mix:
    """A piece whose units are computed from its whole box: mix64 sums, or xxh3 tiles gathered."""

    land: int
    tiling: Tiling
    box: Box
    want: np.ndarray  # digest-vector index of each unit, in ``units_of`` order
    covered: np.ndarray  # bytes of each unit this piece holds
    total: np.ndarray  # bytes of each whole unit
    check: np.ndarray  # bool: the units this piece can check (or add to)
    name: int


@dataclass(frozen=True, slots=True)
class Stream:
    """An xxh3 unit split over pieces (a tile larger than a bucket): hashed in order, across buckets."""

    land: int
    lo: int
    hi: int
    want: int
    start: int
    total: int
    name: int


@dataclass(frozen=True, slots=True)
class Checks:
    lands: tuple[Land, ...]
    names: tuple[str, ...]  # the tensors of this bucket's pieces (for errors)
    # whole xxh3 units contiguous where they landed: one hash call each
    land_of: np.ndarray
    lo: np.ndarray  # byte offsets in the landing buffer
    hi: np.ndarray
    want: np.ndarray
    name_of: np.ndarray
    streams: tuple[Stream, ...]
    mixes: tuple[Mix, ...]  # mix64 pieces, and xxh3 pieces whose whole tiles are strided (gathered)
    whole_bytes: int  # bytes the whole units of ``land_of``/``mixes`` verify
    piece_checked: np.ndarray  # per piece, its bytes inside whole units it checks (its nbytes: all of them)
    piece_bytes: np.ndarray  # per piece, its bytes


class DigestIndex(Mapping[tuple[int, str], tuple[Tiling, int]]):
    """(source, tensor) → (its digest geometry, offset of its first digest in the plan's digest vector).

    Built as the plan reads: ``place`` gives each shard a plan reads its place in the vector, once
    (``order``: its source, position, name and digest geometry), so a version's digests are decoded for the shards read
    alone (``digest_vector``) — a rank at EP 16 of a trillion-parameter model reads 1/16 of its 110 million
    digests, once per version. Shards equal in geometry share one ``Tiling``, as shapes repeat layer after
    layer. ``seal`` gives the geometry: a digest of what fixes the vector's layout — each shard's rank, world
    size, name, dtype, shape, range, digest algorithm and tiles, in order — but not where its bytes lie:
    digests of two versions compare unit by unit only when it is equal (delta refits)."""

    def __init__(self, pub: Publication) -> None:
        self._manifests: tuple[Manifest, ...] = pub.manifests
        self._known: dict[tuple[int, str], tuple[Tiling, int]] = {}
        self._tilings: dict[tuple[Any, ...], Tiling] = {}
        self._shape: list[tuple[Any, ...]] = []  # what ``geometry`` digests
        self.order: list[tuple[int, int, tuple[Any, ...]]] = []
        self._at: list[int] = []  # per shard of ``order``: where its digests start in the vector, and how many
        self._counts: list[int] = []
        self.count = 0  # digests in the vector
        self.runs: DigestRuns | None = None  # where they lie in the manifests' digest blobs (``seal``)

    def place(self, source: int, tensor: str) -> None:
        """Give the shard ``tensor`` of ``source`` its place in the vector, next, unless it has one."""
        key = (source, tensor)
        if key in self._known:
            return
        m = self._manifests[source]
        p = m.positions[tensor]
        spec = m.shards[p]
        place = PLACE(spec)  # its name, then its TILING_KEY
        t = self._tiling(spec, place[1:])
        self._known[key] = (t, self.count)
        self._at.append(self.count)
        self._counts.append(t.count)
        self.count += t.count
        self.order.append((source, p, place))
        self._shape.append((m.rank, m.world_size, *place))

    def __getitem__(self, key: tuple[int, str]) -> tuple[Tiling, int]:
        return self._known[key]

    def seal(self) -> str:
        """The geometry, once the plan placed every shard it reads, and ``runs``; the publication is let go (a
        bucket's checks, made later, look up shards placed)."""
        offsets = {s: self._offsets(s) for s in sorted({s for s, _, _ in self.order})}
        self.runs = DigestRuns.of(offsets, self.order, self._at, self._counts)
        self._manifests, self._tilings, self._at, self._counts = (), {}, [], []
        geometry = xxhash.xxh3_128_hexdigest(orjson.dumps(self._shape))
        self._shape = []
        return geometry

    def _offsets(self, source: int) -> np.ndarray:
        """Where each shard's digests start in ``source``'s digest blob, and its end (every shard's geometry: the
        ones before a shard read place it)."""
        counts = [self._tiling(spec, TILING_KEY(spec)).count for spec in self._manifests[source].shards]
        return np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])

    def _tiling(self, spec: Any, key: tuple[Any, ...]) -> Tiling:
        """``spec``'s digest geometry, one ``Tiling`` for every shard of the same ``key`` (its TILING_KEY)."""
        t = self._tilings.get(key)
        if t is None:
            t = self._tilings[key] = spec.tiling
        return t

    def __iter__(self) -> Iterator[tuple[int, str]]:
        return iter(self._known)

    def __len__(self) -> int:
        return len(self._known)


def used_digests(plan: Any) -> np.ndarray | None:
    """The digest-vector indices a plan's checks read (sorted), once every bucket's checks are made (None before:
    the first version of a plan reads them as they are made). Cached in ``plan.derived``."""
    if "used" in plan.derived:
        return plan.derived["used"]
    if not all(b.is_built for b in plan.buckets):
        return None
    parts = [np.zeros(0, dtype=np.int64)]
    for b in plan.buckets:
        checks = b.built()[0]
        if checks is None:
            continue
        parts.append(checks.want)
        parts.extend(np.array([s.want]) for s in checks.streams)
        parts.extend(m.want for m in checks.mixes)
        breathe()
    used = plan.derived["used"] = np.unique(np.concatenate(parts).astype(np.int64))
    return used


@lru_cache(maxsize=1 << 14)
def _units(t: Tiling, box: Box) -> tuple[Units, tuple[np.ndarray, np.ndarray, np.ndarray, int] | None]:
    """``units_array(t, box)`` (read-only: shared by every plan that meets this geometry), and (lo, covered,
    slot, bytes) of its units when every one is whole and contiguous where the box lands (the common
    case for xxh3), else None. Memoised: a model's pieces repeat layer after layer, and the numpy calls
    per piece were most of a large plan (a 70B TP 1 rank: 9,375 pieces)."""
    ua = units_array(t, box)
    for a in ua:
        a.flags.writeable = False
    whole = t.algo == "xxh3" and bool((ua.covered == ua.total).all() and (ua.mode == 1).all())
    return ua, ((ua.lo, ua.covered, ua.slot, int(ua.total.sum())) if whole else None)


class _Fast:
    """Whole contiguous xxh3 units, gathered into five arrays (land, lo, hi, want, name) from Python
    scalars, pieces' memoised units at their offsets, and numpy arrays. Verify and the delta index
    treat each unit on its own: the arrays are grouped by how they were added, not in plan order."""

    def __init__(self) -> None:
        self.parts: list[tuple[np.ndarray, ...]] = []
        self.scalars: list[tuple[int, int, int, int, int]] = []  # land, lo, hi, want, name
        # land, offset, first digest, name; the units' lo, covered, slot (``_whole_units``)
        self.runs: list[tuple[int, int, int, int, np.ndarray, np.ndarray, np.ndarray]] = []

    def arrays(self) -> tuple[np.ndarray, ...]:
        parts = self.parts
        if self.scalars:
            parts.append(tuple(np.array(c, dtype=np.int64) for c in zip(*self.scalars, strict=True)))
        if self.runs:
            land, offset, base, name, lo, covered, slot = zip(*self.runs, strict=True)
            n = np.array([len(x) for x in lo], dtype=np.int64)
            at = np.concatenate(lo) + np.repeat(np.array(offset, dtype=np.int64), n)
            want = np.concatenate(slot) + np.repeat(np.array(base, dtype=np.int64), n)
            parts.append((np.repeat(np.array(land, dtype=np.int64), n), at, at + np.concatenate(covered), want,
                          np.repeat(np.array(name, dtype=np.int64), n)))  # fmt: skip
        if len(parts) == 1:
            return parts[0]
        if not parts:
            return tuple(np.zeros(0, dtype=np.int64) for _ in range(5))
        return tuple(np.concatenate(c) for c in zip(*parts, strict=True))


def build_checks(
    pieces: Iterable[tuple[int, str, Box, Land]], index: Mapping[tuple[int, str], tuple[Tiling, int]]
) -> Checks:
    """The checks of one bucket's pieces: ``(source, tensor, box, landing)`` each, in plan order."""
    lands: list[Land] = []
    names: list[str] = []
    fast = _Fast()
    streams: list[Stream] = []
    mixes: list[Mix] = []
    whole_bytes = 0
    for source, tensor, box, land in pieces:
        breathe()
        t, base = index[(source, tensor)]
        k, n = len(lands), len(names)
        lands.append(land)
        names.append(tensor)
        if t.algo == "xxh3" and t.count == 1 and land.nbytes == t.nbytes:  # the whole shard, one digest
            fast.scalars.append((k, land.offset, land.offset + land.nbytes, base, n))
            whole_bytes += land.nbytes
            continue
        ua, whole_units = _units(t, box)
        if whole_units is not None:  # the common case: every unit whole
            fast.runs.append((k, land.offset, base, n, *whole_units[:3]))
            whole_bytes += whole_units[3]
            continue
        whole = ua.covered == ua.total
        if t.algo == "mix64" or (ua.mode == 2).any():
            check = ua.mode == (1 if t.algo == "mix64" else 2)
            mixes.append(Mix(k, t, box, base + ua.slot, ua.covered, ua.total, check, n))
            whole_bytes += int(ua.total[check & whole].sum())
            if t.algo == "mix64":
                continue
        sel = (ua.mode == 1) & whole
        lo = land.offset + ua.lo[sel]
        fast.parts.append((np.full(len(lo), k), lo, lo + ua.covered[sel], base + ua.slot[sel], np.full(len(lo), n)))
        whole_bytes += int(ua.total[sel].sum())
        for p in np.flatnonzero((ua.mode == 1) & ~whole).tolist():
            a = land.offset + int(ua.lo[p])
            streams.append(Stream(k, a, a + int(ua.covered[p]), base + int(ua.slot[p]), int(ua.start[p]),
                                  int(ua.total[p]), n))  # fmt: skip
    land_of, lo, hi, want, name_of = fast.arrays()
    checked = np.bincount(land_of, weights=hi - lo, minlength=len(lands))
    for m in mixes:
        checked[m.land] += int(m.covered[m.check & (m.covered == m.total)].sum())
    return Checks(tuple(lands), tuple(names), land_of, lo, hi, want, name_of, tuple(streams), tuple(mixes),
                  whole_bytes, checked.astype(np.int64),
                  np.array([land.nbytes for land in lands], dtype=np.int64))  # fmt: skip


@dataclass(frozen=True, slots=True)
class Credits:
    """The elements one bucket writes into each parameter (commit adds them: O(1) Python per bucket)."""

    params: tuple[str, ...]  # the plan's parameters (shared by every bucket)
    idx: np.ndarray  # positions in ``params``
    counts: np.ndarray


def build_credits(boxes: Iterable[tuple[str, Box]], position: Mapping[str, int], params: tuple[str, ...],
                  units: Mapping[str, int] | None = None) -> Credits:  # fmt: skip
    """Elements per parameter position (``units``: parameters whose boxes count stored values of several)."""
    idx: list[int] = []
    counts: list[int] = []
    units = units or {}
    for param, dbox in boxes:
        idx.append(position[param])
        counts.append(volume(dbox) * units.get(param, 1))
    return Credits(params, np.array(idx, dtype=np.int64), np.array(counts, dtype=np.int64))
