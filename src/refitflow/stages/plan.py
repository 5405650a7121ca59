"""Plan: map a complete publication onto this rank's parameters as buckets of reads.

A plan is data, independent of the bytes: it is computed once per (publication layout, target
layout, limits) and replayed for every later version with the same layout. Every check that can
fail (unknown name or dtype, shape mismatch, overlapping or missing shards, a cast nobody asked for)
fails here, as ``PlanError`` or ``CoverageError``, before any byte is written.

The box copies come from ``_segments`` (receiver segments ∩ publisher segments in canonical space);
regions and chunks from ``_regions``. (The compile filter, ``_filter``, runs in discover, before begin.)
Per source shard, copies become *regions* (boxes of the shard read together): a copy's own box, or,
when its bytes cannot be verified or its runs are too short, the enclosing rows of dim 0 (aligned
to the digest blocks under ``verify="strict"``); overlapping regions merge. Regions are cut into
pieces of at most a bucket and ``max_strided_runs`` runs. A piece lands straight in its parameter
when it is one contiguous copy in both places with the same dtype; otherwise it is staged (its box
laid out row-major) and *scatters* to one or more destination boxes.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import anyio.to_thread
import torch
from anyio.abc import ObjectReceiveStream, ObjectSendStream

from refitflow.core.dtypes import dtype_from_name, dtype_name
from refitflow.core.errors import PlanError
from refitflow.core.types import Publication, ShardSpec
from refitflow.layouts.boxes import (
    Box,
    contiguous_span,
    intersect,
    row_runs,
    shape_of,
    shift,
    volume,
)
from refitflow.layouts.canonical import sliced
from refitflow.stages._context import Landing, Limits, StageContext
from refitflow.stages._filter import check_compile
from refitflow.stages._regions import chunks, regions
from refitflow.stages._segments import Copy, copies

__all__ = [
    "Bucket",
    "Piece",
    "Plan",
    "PlanCache",
    "PlannedRead",
    "Scatter",
    "box_index",
    "build_plan",
    "check_compile",
    "run",
]


_SERIALS = itertools.count()


@dataclass(frozen=True, slots=True)
class Scatter:
    """``piece[sub]`` (source coordinates, inside the piece's box) → ``param[dbox]``."""

    param: str
    sub: Box
    dbox: Box


@dataclass(frozen=True, slots=True)
class Piece:
    """A box of one source shard, read as ``spans`` (element runs, in landing order)."""

    source: int  # index of the manifest in the publication
    tensor: str  # the source shard's name
    src_dtype: str
    box: Box  # in the shard's local coordinates
    spans: tuple[tuple[int, int], ...]  # (first element, count) of the shard, in landing order
    src_region: int
    src_offset: int  # the shard's byte offset in its region
    nbytes: int
    direct: bool  # lands straight in the destination: no staging, no copy
    landing_offset: int  # direct: byte offset in the parameter; staged: byte offset in the bucket
    scatters: tuple[Scatter, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return shape_of(self.box)


@dataclass(frozen=True, slots=True)
class PlannedRead:
    """One coalesced contiguous read: source bytes → a parameter (direct) or the bucket's staging."""

    source: int
    region: int
    src_offset: int
    nbytes: int
    param: str | None  # None: into staging
    landing_offset: int


@dataclass(frozen=True, slots=True)
class Bucket:
    index: int
    pieces: tuple[Piece, ...]
    reads: tuple[PlannedRead, ...]
    staging_bytes: int
    direct_bytes: int

    @property
    def nbytes(self) -> int:
        return self.staging_bytes + self.direct_bytes


@dataclass(frozen=True, kw_only=True)
class Plan:
    key: Hashable
    buckets: tuple[Bucket, ...]
    nbytes: int
    ideal_bytes: int = 0  # the source bytes of the copies alone (what a perfect plan would read)
    seconds: float = 0.0  # time it took to build
    serial: int = field(default_factory=lambda: next(_SERIALS))  # unique per plan built in this process
    read_lists: dict[Hashable, Any] = field(default_factory=dict, compare=False, repr=False)  # see pull.reads_of


def box_index(box: Box) -> tuple[slice, ...]:
    return tuple(slice(s, e) for s, e in box)


def _check_cast(src: torch.dtype, dst: torch.dtype, limits: Limits, tensor: str) -> None:
    if src == dst or limits.lossy_casts:
        return
    if src.is_floating_point and dst.is_floating_point and torch.promote_types(src, dst) == dst:
        if torch.finfo(dst).bits > torch.finfo(src).bits:
            return
    raise PlanError(f"casting {src} to {dst} loses information and lossy_casts is off", tensor=tensor)


def _pieces(pub: Publication, landing: Landing, limits: Limits) -> Iterator[Piece]:
    exact = landing.layout is None
    scales = set(landing.derived.values())
    dest = landing.layout or {n: sliced(n, tuple(t.shape)) for n, t in landing.params.items() if n not in scales}
    groups: dict[tuple[int, str], list[Copy]] = {}
    for c in copies(pub, dest, landing.canonical, exact):
        dst = landing.params[c.param]
        dtype_name(dst.dtype, tensor=c.param)
        src = dtype_from_name(c.spec.dtype, tensor=c.spec.name)
        if c.param in landing.derived:  # quantised: assembled in fp32 first
            _check_cast(src, torch.float32, limits, c.spec.name)
        else:
            _check_cast(src, dst.dtype, limits, c.spec.name)
        groups.setdefault((c.source, c.spec.name), []).append(c)
    for (source, _), cs in groups.items():
        spec: ShardSpec = cs[0].spec
        src_dtype = dtype_from_name(spec.dtype)
        item, shape = src_dtype.itemsize, spec.shape
        for region, members in regions(cs, shape, item, limits):
            c = members[0]
            dst = landing.params[c.param]
            direct = (
                len(members) == 1 and region == c.sbox and src_dtype == dst.dtype
                and contiguous_span(region, shape) is not None and contiguous_span(c.dbox, tuple(dst.shape)) is not None
            )  # fmt: skip
            cap = limits.direct_bucket_bytes if direct else limits.bucket_bytes
            for chunk in chunks(region, shape, item, cap, limits.max_strided_runs):
                scatters = []
                for m in members:
                    sub = intersect(chunk, m.sbox) if shape else chunk
                    if sub is not None:
                        scatters.append(Scatter(m.param, sub, shift(sub, m.sbox, m.dbox) if shape else m.dbox))
                spans = tuple(row_runs(chunk, shape)) if shape else ((0, 1),)
                landing_offset = 0
                if direct:
                    span = contiguous_span(scatters[0].dbox, tuple(dst.shape))
                    assert span is not None
                    landing_offset = span[0] * dst.element_size()
                yield Piece(
                    source=source, tensor=spec.name, src_dtype=spec.dtype, box=chunk, spans=spans,
                    src_region=spec.region, src_offset=spec.offset, nbytes=volume(chunk) * item, direct=direct,
                    landing_offset=landing_offset, scatters=tuple(scatters),
                )  # fmt: skip


def _bucket(index: int, pieces: list[Piece]) -> Bucket:
    """Lay staged pieces out one after another and coalesce adjacent reads."""
    laid: list[Piece] = []
    reads: list[PlannedRead] = []
    staged = 0
    for p in pieces:
        if not p.direct:
            p = replace(p, landing_offset=staged)
            staged += p.nbytes
        laid.append(p)
        param = p.scatters[0].param if p.direct else None
        item = p.nbytes // max(sum(n for _, n in p.spans), 1)
        at = p.landing_offset
        for first, count in p.spans:
            src, n = p.src_offset + first * item, count * item
            prev = reads[-1] if reads else None
            if (
                prev is not None
                and (prev.source, prev.region, prev.param) == (p.source, p.src_region, param)
                and prev.src_offset + prev.nbytes == src
                and prev.landing_offset + prev.nbytes == at
            ):
                reads[-1] = replace(prev, nbytes=prev.nbytes + n)
            else:
                reads.append(PlannedRead(p.source, p.src_region, src, n, param, at))
            at += n
    direct = sum(p.nbytes for p in laid if p.direct)
    return Bucket(index, tuple(laid), tuple(reads), staging_bytes=staged, direct_bytes=direct)


def build_plan(pub: Publication, landing: Landing, limits: Limits, key: Hashable = None) -> Plan:
    """Every read this rank needs, grouped into buckets of at most the limits' sizes."""
    t0 = time.perf_counter()
    buckets: list[Bucket] = []
    current: list[Piece] = []
    staged = direct = runs = ideal = 0
    for p in _pieces(pub, landing, limits):
        ideal += sum(volume(s.sub) for s in p.scatters) * (p.nbytes // max(volume(p.box), 1))
        full_ = (
            (not p.direct and staged + p.nbytes > limits.bucket_bytes)
            or (p.direct and direct + p.nbytes > limits.direct_bucket_bytes)
            or runs + len(p.spans) > limits.max_reads_per_bucket
        )
        if current and full_:
            buckets.append(_bucket(len(buckets), current))
            current, staged, direct, runs = [], 0, 0, 0
        current.append(p)
        staged += 0 if p.direct else p.nbytes
        direct += p.nbytes if p.direct else 0
        runs += len(p.spans)
    if current:
        buckets.append(_bucket(len(buckets), current))
    total = sum(b.nbytes for b in buckets)
    return Plan(key=key, buckets=tuple(buckets), nbytes=total, ideal_bytes=ideal, seconds=time.perf_counter() - t0)


class PlanCache:
    """Plans by (publication layout, target layout, limits); a few kept, least recently used dropped."""

    def __init__(self, size: int = 4) -> None:
        self._plans: OrderedDict[Hashable, Plan] = OrderedDict()
        self._size = size
        self.hits = 0
        self.misses = 0
        self._landing: tuple[Landing, Hashable] | None = None

    def key(self, pub: Publication, landing: Landing, limits: Limits) -> Hashable:
        if self._landing is None or self._landing[0] is not landing:  # the target layout: once per landing
            target = (
                tuple((n, tuple(t.shape), t.dtype) for n, t in landing.params.items()),
                tuple(sorted(landing.canonical.items())),
                landing.layout_key,
            )
            self._landing = (landing, target)
        return (pub.layout_key(), self._landing[1], limits)

    def lookup(self, key: Hashable) -> Plan | None:
        plan = self._plans.get(key)
        if plan is not None:
            self.hits += 1
            self._plans.move_to_end(key)
        return plan

    def store(self, plan: Plan) -> None:
        self.misses += 1
        self._plans[plan.key] = plan
        if len(self._plans) > self._size:
            self._plans.popitem(last=False)

    async def get(self, pub: Publication, landing: Landing, limits: Limits) -> Plan:
        """The cached plan, or a new one built in a worker thread (a big model's plan takes tens of ms)."""
        key = self.key(pub, landing, limits)
        plan = self.lookup(key)
        if plan is None:
            plan = await anyio.to_thread.run_sync(build_plan, pub, landing, limits, key)
            self.store(plan)
        return plan


async def run(
    ctx: StageContext,
    cache: PlanCache,
    receive: ObjectReceiveStream[Publication],
    send: ObjectSendStream[Bucket],
) -> None:
    """Plan the publication, then send its buckets downstream in order."""
    async with receive, send:
        async for pub in receive:
            ctx.enter("plan")
            t0 = time.perf_counter()
            plan = await cache.get(pub, ctx.landing, ctx.limits)
            ctx.plan = plan
            ctx.note("plan", len(plan.buckets), plan.nbytes, time.perf_counter() - t0)
            for bucket in plan.buckets:
                await send.send(bucket)
