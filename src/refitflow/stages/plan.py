"""Plan: map a complete publication onto this rank's parameters as buckets of reads.

A plan is data, independent of the bytes: it is computed once per (publication layout, target
layout, limits) and replayed for every later version with the same layout. Every check that can
fail (unknown name or dtype, shape mismatch, overlapping or missing shards, a cast nobody asked for)
fails here, as ``PlanError`` or ``CoverageError``, before any byte is written.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import OrderedDict
from collections.abc import Hashable, Iterator, Mapping
from dataclasses import dataclass, field, replace

import torch
from anyio.abc import ObjectReceiveStream, ObjectSendStream

from refitflow.core.dtypes import dtype_from_name, dtype_name
from refitflow.core.errors import CoverageError, PlanError
from refitflow.core.types import Publication, ShardSpec
from refitflow.stages._context import Landing, Limits, StageContext
from refitflow.stages.sources import SourceLoad

__all__ = ["Bucket", "Piece", "Plan", "PlanCache", "PlannedRead", "build_plan", "piece_view", "run"]


_SERIALS = itertools.count()


@dataclass(frozen=True, slots=True)
class Piece:
    """A box of one source shard and where it lands in one destination parameter."""

    source: int  # index of the manifest in the publication
    tensor: str  # the source tensor's name
    param: str  # the canonical destination parameter
    src_dtype: str
    shape: tuple[int, ...]  # the piece's shape (source layout)
    axis: int | None  # the shard's place in the parameter: dst.narrow(axis, start, stop - start)
    start: int
    stop: int
    index: tuple[int, ...]  # then [index] into the leading dims, then rows [r0, r1)
    r0: int
    r1: int
    src_region: int
    src_offset: int
    nbytes: int
    direct: bool  # lands straight in the destination: no staging, no copy
    landing_offset: int  # direct: byte offset in the parameter; staged: byte offset in the bucket
    first: bool  # first / last piece of its shard (the digest streams across pieces in order)
    last: bool

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def region_key(self) -> Hashable:
        return (self.axis, self.start, self.stop, self.index, self.r0, self.r1)


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
    seconds: float = 0.0  # time it took to build
    serial: int = field(default_factory=lambda: next(_SERIALS))  # unique per plan built in this process


def piece_view(target: torch.Tensor, p: Piece) -> torch.Tensor:
    """The part of ``target`` (a destination parameter) that piece ``p`` covers."""
    view = target if p.axis is None else target.narrow(p.axis, p.start, p.stop - p.start)
    if p.index:
        view = view[p.index]
    if view.dim() == 0:
        return view
    return view[p.r0 : p.r1]


def _split(shape: tuple[int, ...], item: int, cap: int, index: tuple[int, ...] = ()) -> Iterator[tuple]:
    """Boxes of a contiguous shape, each ≤ ``cap`` bytes: (index into leading dims, r0, r1, shape)."""
    if not shape:
        yield index, 0, 1, ()
        return
    rows, row_shape = shape[0], shape[1:]
    row_bytes = math.prod(row_shape) * item
    if row_bytes * rows <= cap:
        yield index, 0, rows, shape
    elif row_bytes <= cap:
        step = cap // max(row_bytes, 1)
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            yield index, r0, r1, (r1 - r0, *row_shape)
    else:
        for i in range(rows):
            yield from _split(row_shape, item, cap, (*index, i))


def _flat_offset(shape: tuple[int, ...], index: tuple[int, ...], r0: int) -> int:
    strides = [math.prod(shape[k + 1 :]) for k in range(len(shape))]
    pos = (*index, r0) if shape else ()
    return sum(i * s for i, s in zip(pos, strides, strict=False))


def _check_cast(src: torch.dtype, dst: torch.dtype, limits: Limits, tensor: str) -> None:
    if src == dst or limits.lossy_casts:
        return
    if src.is_floating_point and dst.is_floating_point and torch.promote_types(src, dst) == dst:
        if torch.finfo(dst).bits > torch.finfo(src).bits:
            return
    raise PlanError(f"casting {src} to {dst} loses information and lossy_casts is off", tensor=tensor)


def _choose_shards(pub: Publication, landing_canonical: Mapping[str, str]) -> dict[str, list[tuple[int, ShardSpec]]]:
    """canonical parameter -> [(source index, spec)] covering it, validated; aliases counted once."""
    by_tensor: dict[str, list[tuple[int, ShardSpec]]] = {}
    load = SourceLoad(trainers=len(pub.manifests))
    for i, m in enumerate(pub.sources):
        for spec in m.shards:
            by_tensor.setdefault(spec.name, []).append((i, spec))
    unknown = sorted(n for n in by_tensor if n not in landing_canonical)
    if unknown:
        raise PlanError(f"the model has no parameter named {unknown[:20]}", version=pub.version)
    chosen: dict[str, list[tuple[int, ShardSpec]]] = {}
    for name in sorted(by_tensor, key=lambda n: (landing_canonical[n] != n, n)):
        param = landing_canonical[name]
        if param in chosen:  # a tied alias published under a second name: the weight counts once
            continue
        shards = by_tensor[name]
        whole = [(i, s) for i, s in shards if s.axis is None]
        if whole:  # replicated (trainer ranks or replica sources): read from one, spread by load
            chosen[param] = [load.choose(whole)]
            continue
        chosen[param] = _tile(name, shards, pub.version)
    return chosen


def _tile(name: str, shards: list[tuple[int, ShardSpec]], version: int) -> list[tuple[int, ShardSpec]]:
    first = shards[0][1]
    for _, s in shards:
        if (s.axis, s.global_shape, s.dtype) != (first.axis, first.global_shape, first.dtype):
            raise PlanError(
                f"shards disagree: axis/shape/dtype {(s.axis, s.global_shape, s.dtype)} vs "
                f"{(first.axis, first.global_shape, first.dtype)}",
                tensor=name,
                version=version,
            )
    assert first.axis is not None
    ordered = sorted(shards, key=lambda x: x[1].start)
    pos = 0
    for _, s in ordered:
        if s.start < pos:
            raise PlanError(f"overlapping shards on axis {s.axis} at [{s.start}, {pos})", tensor=name, version=version)
        if s.start > pos:
            raise PlanError(f"coverage gap in {name} axis {s.axis} [{pos}, {s.start})", tensor=name, version=version)
        pos = s.stop
    if pos < first.global_shape[first.axis]:
        raise PlanError(
            f"coverage gap in {name} axis {first.axis} [{pos}, {first.global_shape[first.axis]})",
            tensor=name,
            version=version,
        )
    return ordered


def _pieces(pub: Publication, landing: Landing, limits: Limits) -> Iterator[Piece]:
    chosen = _choose_shards(pub, landing.canonical)
    missing = sorted(set(landing.params) - set(chosen))
    if missing:
        raise CoverageError("the publication does not cover every parameter", missing=missing, version=pub.version)
    for param, shards in chosen.items():
        dst = landing.params[param]
        dtype_name(dst.dtype, tensor=param)
        for source, spec in shards:
            src_dtype = dtype_from_name(spec.dtype, tensor=spec.name)
            if tuple(dst.shape) != spec.global_shape:
                raise PlanError(
                    f"shape mismatch: publication {spec.global_shape}, model {tuple(dst.shape)}",
                    tensor=spec.name,
                    version=pub.version,
                )
            _check_cast(src_dtype, dst.dtype, limits, spec.name)
            meta = torch.empty(spec.global_shape, dtype=dst.dtype, device="meta")
            shard_view = meta if spec.axis is None else meta.narrow(spec.axis, spec.start, spec.stop - spec.start)
            direct = src_dtype == dst.dtype and shard_view.is_contiguous()
            cap = limits.direct_bucket_bytes if direct else limits.bucket_bytes
            boxes = list(_split(spec.shape, src_dtype.itemsize, cap))
            for k, (index, r0, r1, shape) in enumerate(boxes):
                p = Piece(
                    source=source, tensor=spec.name, param=param, src_dtype=spec.dtype, shape=shape,
                    axis=spec.axis, start=spec.start, stop=spec.stop, index=index, r0=r0, r1=r1,
                    src_region=spec.region,
                    src_offset=spec.offset + _flat_offset(spec.shape, index, r0) * src_dtype.itemsize,
                    nbytes=math.prod(shape) * src_dtype.itemsize, direct=direct, landing_offset=0,
                    first=k == 0, last=k == len(boxes) - 1,
                )  # fmt: skip
                if direct:
                    p = replace(p, landing_offset=int(piece_view(meta, p).storage_offset()) * dst.element_size())
                yield p


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
        param = p.param if p.direct else None
        prev = reads[-1] if reads else None
        if (
            prev is not None
            and (prev.source, prev.region, prev.param) == (p.source, p.src_region, param)
            and prev.src_offset + prev.nbytes == p.src_offset
            and prev.landing_offset + prev.nbytes == p.landing_offset
        ):
            reads[-1] = replace(prev, nbytes=prev.nbytes + p.nbytes)
        else:
            reads.append(PlannedRead(p.source, p.src_region, p.src_offset, p.nbytes, param, p.landing_offset))
    direct = sum(p.nbytes for p in laid if p.direct)
    return Bucket(index, tuple(laid), tuple(reads), staging_bytes=staged, direct_bytes=direct)


def build_plan(pub: Publication, landing: Landing, limits: Limits, key: Hashable = None) -> Plan:
    """Every read this rank needs, grouped into buckets of at most the limits' sizes."""
    t0 = time.perf_counter()
    buckets: list[Bucket] = []
    current: list[Piece] = []
    staged = direct = 0
    for p in _pieces(pub, landing, limits):
        full = (
            (not p.direct and staged + p.nbytes > limits.bucket_bytes)
            or (p.direct and direct + p.nbytes > limits.direct_bucket_bytes)
            or len(current) >= limits.max_reads_per_bucket
        )
        if current and full:
            buckets.append(_bucket(len(buckets), current))
            current, staged, direct = [], 0, 0
        current.append(p)
        staged += 0 if p.direct else p.nbytes
        direct += p.nbytes if p.direct else 0
    if current:
        buckets.append(_bucket(len(buckets), current))
    total = sum(b.nbytes for b in buckets)
    return Plan(key=key, buckets=tuple(buckets), nbytes=total, seconds=time.perf_counter() - t0)


class PlanCache:
    """Plans by (publication layout, target layout, limits); a few kept, least recently used dropped."""

    def __init__(self, size: int = 4) -> None:
        self._plans: OrderedDict[Hashable, Plan] = OrderedDict()
        self._size = size
        self.hits = 0
        self.misses = 0

    def get(self, pub: Publication, landing: Landing, limits: Limits) -> Plan:
        key = (
            pub.layout_key(),
            tuple((n, tuple(t.shape), t.dtype) for n, t in landing.params.items()),
            tuple(sorted(landing.canonical.items())),
            limits,
        )
        plan = self._plans.get(key)
        if plan is not None:
            self.hits += 1
            self._plans.move_to_end(key)
            return plan
        self.misses += 1
        plan = build_plan(pub, landing, limits, key)
        self._plans[key] = plan
        if len(self._plans) > self._size:
            self._plans.popitem(last=False)
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
            plan = cache.get(pub, ctx.landing, ctx.limits)
            ctx.plan = plan
            ctx.note("plan", len(plan.buckets), plan.nbytes, time.perf_counter() - t0)
            for bucket in plan.buckets:
                await send.send(bucket)
