"""Plan: map a complete publication onto this rank's parameters as buckets of reads.

A plan is data, independent of the bytes: it is computed once per (publication layout, target
layout, limits) and replayed for every later version with the same layout. Every check that can
fail (unknown name or dtype, shape mismatch, overlapping or missing shards, a cast nobody asked for)
fails here, as ``PlanError`` or ``CoverageError``, before any byte is written.

The box copies come from ``_segments`` (receiver segments ∩ publisher segments in canonical space);
regions and chunks from ``_regions``. (The compile filter, ``_filter``, runs in discover, before begin.)
Per source shard, copies become *regions* (boxes of the shard read together): a copy's own box, or,
under ``verify="strict"``, the box widened to whole digest tiles; with runs too short, the enclosing
rows of dim 0; overlapping widened regions merge. Regions are cut into pieces of at most a bucket and
``max_strided_runs`` runs, each one *strided read* (equally spaced runs: one planned read however many
rows a column slice has; transports expand it). A piece lands straight in its parameter when it is
one contiguous copy in both places with the same dtype; otherwise it is staged (its box laid out
row-major, at an 8-byte aligned offset) and *scatters* to one or more destination boxes.

Each bucket also carries what verify and commit need (``_checks``), so a replayed plan does no
per-tensor planning work at all. Building runs in a worker thread and lets the event loop take the
GIL every half millisecond.

The per-tensor records (``Piece``, ``Scatter``, ``PlannedRead``; ``_segments.Copy`` and ``Held``,
``_checks.Land``) are slots dataclasses that are not frozen: a first plan of 10,000 tensors makes about
60,000 of them, and a frozen one costs 2–3× as much to construct (≈ 45 ms of that plan). Nothing
writes to a built plan. What plans need of the landing itself is built once per landing (``_target``).
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
from refitflow.layouts.boxes import Box, contiguous_span, intersect, shape_of, shift, strided, volume
from refitflow.stages._checks import Checks, Credits, Land, build_checks, build_credits, digest_index, digest_vector
from refitflow.stages._context import Landing, Limits, StageContext, Work, breathe, built
from refitflow.stages._delta import DeltaIndex, Skips, decide
from refitflow.stages._filter import check_compile
from refitflow.stages._regions import chunks, regions
from refitflow.stages._segments import Copy, copies
from refitflow.stages._target import Target

__all__ = [
    "Bucket",
    "Piece",
    "Plan",
    "PlanCache",
    "PlannedRead",
    "Scatter",
    "box_index",
    "build_plan",
    "check_cast",
    "check_compile",
    "coalesce",
    "piece_read",
    "run",
]


_SERIALS = itertools.count()
_DIRECT_PIECE = 16 << 20  # direct pieces are cut this small so the last buckets can taper
_TAPER_MIN = 4 << 20


@dataclass(slots=True, unsafe_hash=True)  # a plan record: see plan.py
class Scatter:
    """``piece[sub]`` (source coordinates, inside the piece's box) → ``param[dbox]``."""

    param: str
    sub: Box
    dbox: Box


@dataclass(slots=True, unsafe_hash=True)  # a plan record: see plan.py
class Piece:
    """A box of one source shard, read as ``count`` runs of ``run`` elements, ``stride`` apart."""

    source: int  # index of the manifest in the publication
    tensor: str  # the source shard's name
    src_dtype: str
    box: Box  # in the shard's local coordinates
    first: int  # the shard element the first run starts at
    run: int  # elements per run
    stride: int  # elements from one run's start to the next (0: one run)
    count: int  # runs
    src_region: int
    src_offset: int  # the shard's byte offset in its region
    nbytes: int
    direct: bool  # lands straight in the destination: no staging, no copy
    landing_offset: int  # direct: byte offset in the parameter; staged: byte offset in the bucket
    scatters: tuple[Scatter, ...]
    device: str  # where it lands: its parameter's device (direct), the staging ring's (staged)

    @property
    def shape(self) -> tuple[int, ...]:
        return shape_of(self.box)


@dataclass(slots=True, unsafe_hash=True)  # a plan record: see plan.py
class PlannedRead:
    """One read: ``count`` runs of ``nbytes`` source bytes, ``stride`` apart, landing back to back in a
    parameter (direct) or the bucket's staging."""

    source: int
    region: int
    src_offset: int
    nbytes: int  # per run
    param: str | None  # None: into staging
    landing_offset: int
    stride: int = 0  # source bytes from one run's start to the next
    count: int = 1


@dataclass(frozen=True, slots=True)
class Bucket:
    index: int
    pieces: tuple[Piece, ...]
    reads: tuple[PlannedRead, ...]
    staging_bytes: int  # the staging lease (staged pieces at 8-byte aligned offsets)
    direct_bytes: int
    device: str  # the device of its staging (all its staged pieces land on one device)
    devices: tuple[str, ...]  # every device its work touches: staging and destinations
    staged: tuple[Piece, ...] = ()  # the pieces translate and apply handle
    checks: Checks | None = None
    credits: Credits | None = None
    derived: tuple[Scatter, ...] = ()  # scatters into float8 parameters (assembled, then quantised)
    pulled_bytes: int = 0

    @property
    def nbytes(self) -> int:
        """Source bytes pulled."""
        return self.pulled_bytes


@dataclass(frozen=True, kw_only=True)
class Plan:
    key: Hashable
    buckets: tuple[Bucket, ...]
    nbytes: int
    ideal_bytes: int = 0  # the source bytes of the copies alone (what a perfect plan would read)
    seconds: float = 0.0  # time it took to build
    serial: int = field(default_factory=lambda: next(_SERIALS))  # unique per plan built in this process
    copies: tuple[Copy, ...] = ()  # every box copy (what a relay holds: stages._relay.held_boxes)
    digest_geometry: str = ""  # Publication.digest_geometry of the publications it plans
    target: Target | None = field(default=None, compare=False, repr=False)  # the landing it was built for
    read_lists: dict[Hashable, Any] = field(default_factory=dict, compare=False, repr=False)  # see pull.reads_of
    views: dict[Hashable, Any] = field(default_factory=dict, compare=False, repr=False)  # see verify
    # built on first use, once per plan: relay geometries by relay layout, the delta index, this rank's
    # relay boxes (stages._relay, stages._delta); per-bucket variants by skip pattern
    derived: dict[Hashable, Any] = field(default_factory=dict, compare=False, repr=False)


def box_index(box: Box) -> tuple[slice, ...]:
    return tuple(slice(s, e) for s, e in box)


def check_cast(src: torch.dtype, dst: torch.dtype, lossy: bool, tensor: str) -> None:
    """Refuse (``PlanError``) a cast that loses information unless ``lossy`` casts were asked for."""
    if src == dst or lossy:
        return
    if src.is_floating_point and dst.is_floating_point and torch.promote_types(src, dst) == dst:
        if torch.finfo(dst).bits > torch.finfo(src).bits:
            return
    raise PlanError(f"casting {src} to {dst} loses information and lossy_casts is off", tensor=tensor)


def _pieces(cs_all: list[Copy], target: Target, limits: Limits) -> Iterator[Piece]:
    landing = target.landing
    groups: dict[tuple[int, str], list[Copy]] = {}
    casts: set[tuple[str, torch.dtype, bool]] = set()
    for c in cs_all:
        dst = landing.params[c.param]
        key = (c.spec.dtype, dst.dtype, c.param in landing.derived)
        if key not in casts:
            dtype_name(dst.dtype, tensor=c.param)
            src = dtype_from_name(c.spec.dtype, tensor=c.spec.name)
            # quantised parameters are assembled in fp32 first
            check_cast(src, torch.float32 if key[2] else dst.dtype, limits.lossy_casts, c.spec.name)
            casts.add(key)
        groups.setdefault((c.source, c.spec.name), []).append(c)
    shapes: dict[Hashable, list[_Shape]] = {}  # a model's shards repeat their geometry layer after layer
    for (source, _), cs in groups.items():
        breathe()
        spec: ShardSpec = cs[0].spec
        dsts = [landing.params[c.param] for c in cs]
        like = (spec.shape, spec.dtype, spec.algo, spec.tile_rows, spec.tile_cols,
                tuple((c.sbox, c.dbox, t.dtype, t.shape) for c, t in zip(cs, dsts, strict=True)))  # fmt: skip
        geometry = shapes.get(like)
        if geometry is None:
            geometry = shapes[like] = _geometry(spec, cs, dsts, limits)
        for box, runs, nbytes, direct, offset, scatters, lands in geometry:
            yield Piece(
                source=source, tensor=spec.name, src_dtype=spec.dtype, box=box, first=runs[0], run=runs[1],
                stride=runs[2], count=runs[3], src_region=spec.region, src_offset=spec.offset, nbytes=nbytes,
                direct=direct, landing_offset=offset, device=target.device[cs[lands].param],
                scatters=tuple(Scatter(cs[m].param, sub, dbox) for m, sub, dbox in scatters),
            )  # fmt: skip


# a piece of a shard by member index: (box, runs, bytes, direct, landing offset, scatters as (member, sub,
# dbox), the member whose device it lands on: its first scatter's, else its region's first member's)
_Shape = tuple[Box, tuple[int, int, int, int], int, bool, int, list[tuple[int, Box, Box]], int]


def _geometry(spec: ShardSpec, cs: list[Copy], dsts: list[torch.Tensor], limits: Limits) -> list[_Shape]:
    """The pieces of one shard's copies, by member index (no names: shards of one geometry share it)."""
    src_dtype = dtype_from_name(spec.dtype)
    item, shape = src_dtype.itemsize, spec.shape
    tiling = spec.tiling
    grid = _grid(tiling, len(shape))
    index = {id(c): i for i, c in enumerate(cs)}
    out: list[_Shape] = []
    for region, members in regions(cs, shape, item, limits, tiling):
        c, dst = members[0], dsts[index[id(members[0])]]
        direct = (
            len(members) == 1 and region == c.sbox and src_dtype == dst.dtype
            and contiguous_span(region, shape) is not None and contiguous_span(c.dbox, tuple(dst.shape)) is not None
        )  # fmt: skip
        cap = min(limits.direct_bucket_bytes, _DIRECT_PIECE) if direct else limits.bucket_bytes
        for chunk in chunks(region, shape, item, cap, limits.max_strided_runs, grid):
            scatters = []
            for m in members:
                sub = intersect(chunk, m.sbox) if shape else chunk
                if sub is not None:
                    scatters.append((index[id(m)], sub, shift(sub, m.sbox, m.dbox) if shape else m.dbox))
            runs = strided(chunk, shape) if shape else (0, 1, 0, 1)
            assert runs is not None  # chunks() yields strided boxes only
            offset = 0
            if direct:
                span = contiguous_span(scatters[0][2], tuple(dst.shape))
                assert span is not None
                offset = span[0] * dst.element_size()
            lands = scatters[0][0] if scatters else index[id(c)]
            out.append((chunk, runs, volume(chunk) * item, direct, offset, scatters, lands))
    return out


def _grid(tiling: Any, ndim: int) -> tuple[int, ...] | None:
    """Per dimension, the multiple piece cuts fall on: the digest tiles' rows and columns."""
    if tiling.tile_rows == 0 or ndim == 0:
        return None
    if ndim == 1:
        return (tiling.tile_cols,)
    return (*([1] * (ndim - 2)), tiling.tile_rows, tiling.tile_cols)


class _Context:
    """What every bucket of one plan shares: the digest index, the parameters, the boxes seen."""

    def __init__(self, pub: Publication, target: Target) -> None:
        self.index = digest_index(pub)
        self.params = target.names
        self.position = target.position
        self.derived = target.landing.derived
        self.device = target.device
        self.seen: set[tuple[str, Box]] = set()


def piece_read(p: Piece) -> PlannedRead:
    """The one read of a piece from its trainer source (runs back to back become one run)."""
    item = p.nbytes // max(p.run * p.count, 1)
    return runs_read(p.source, p.src_region, p.src_offset + p.first * item, p.run * item, p.stride * item, p.count,
                     p.scatters[0].param if p.direct else None, p.landing_offset)  # fmt: skip


def runs_read(
    source: int, region: int, src: int, n: int, stride: int, count: int, param: str | None, at: int
) -> PlannedRead:
    """``count`` runs of ``n`` bytes ``stride`` apart as one planned read (one run when back to back)."""
    if count > 1 and stride == n:
        n, count = n * count, 1
    return PlannedRead(source, region, src, n, param, at, stride if count > 1 else 0, count)


def coalesce(reads: Iterator[PlannedRead] | list[PlannedRead]) -> list[PlannedRead]:
    """Reads in landing order, each run that continues the previous one in both places merged into it."""
    out: list[PlannedRead] = []
    for r in reads:
        prev = out[-1] if out else None
        if (
            r.count == 1 and prev is not None and prev.count == 1
            and (prev.source, prev.region, prev.param) == (r.source, r.region, r.param)
            and prev.src_offset + prev.nbytes == r.src_offset and prev.landing_offset + prev.nbytes == r.landing_offset
        ):  # fmt: skip
            out[-1] = replace(prev, nbytes=prev.nbytes + r.nbytes)
        else:
            out.append(r)
    return out


def _bucket(index: int, pieces: list[Piece], cx: _Context) -> Bucket:
    """Lay staged pieces out one after another (8-byte aligned), coalesce adjacent reads, precompute checks."""
    laid: list[Piece] = []
    staged = 0
    for p in pieces:
        breathe()
        if not p.direct:
            staged = -(-staged // 8) * 8
            p = replace(p, landing_offset=staged)
            staged += p.nbytes
        laid.append(p)
    reads = coalesce([piece_read(p) for p in laid])
    for p in laid:
        for s in p.scatters:
            if (s.param, s.dbox) in cx.seen:
                raise PlanError(f"box {s.dbox} of {s.param} would be written twice", tensor=s.param)
            cx.seen.add((s.param, s.dbox))
    direct = sum(p.nbytes for p in laid if p.direct)
    checks = build_checks(
        ((p.source, p.tensor, p.box, Land(p.scatters[0].param if p.direct else None, p.landing_offset, p.nbytes))
         for p in laid),
        cx.index,
    )  # fmt: skip
    scatters = [s for p in laid for s in p.scatters]
    credits = build_credits(((s.param, s.dbox) for s in scatters), cx.position, cx.params)
    device = next((p.device for p in laid if not p.direct), laid[0].device)
    touched = {p.device for p in laid} | {cx.device[s.param] for s in scatters}
    return Bucket(
        index, tuple(laid), tuple(reads), staging_bytes=-(-staged // 8) * 8, direct_bytes=direct,
        device=device, devices=tuple(sorted(touched, key=lambda d: (d != "cpu", d))),
        staged=tuple(p for p in laid if not p.direct), checks=checks, credits=credits,
        derived=tuple(s for s in scatters if s.param in cx.derived), pulled_bytes=sum(p.nbytes for p in laid),
    )  # fmt: skip


def build_plan(
    pub: Publication, landing: Landing, limits: Limits, key: Hashable = None, target: Target | None = None
) -> Plan:
    """Every read this rank needs, grouped into buckets of at most the limits' sizes (``target``: the
    landing's, when the caller keeps it)."""
    return built(_build, pub, target if target is not None and target.landing is landing else Target(landing),
                 limits, key)  # fmt: skip


def _build(pub: Publication, target: Target, limits: Limits, key: Hashable) -> Plan:
    t0 = time.perf_counter()
    cx = _Context(pub, target)
    buckets: list[Bucket] = []
    current: list[Piece] = []
    staged = direct = runs = ideal = 0
    staging_device = None  # a bucket stages on one device: a staged piece for another starts a new bucket
    cs = copies(pub, target.layout, target.landing.canonical, target.exact)
    pieces = list(_pieces(cs, target, limits))
    left = sum(p.nbytes for p in pieces if p.direct)  # direct bytes not yet in a bucket
    for p in pieces:
        ideal += sum(volume(s.sub) for s in p.scatters) * (p.nbytes // max(volume(p.box), 1))
        # the last direct buckets taper (half of what is left, at least 4 MiB): the last bucket's
        # verification, which nothing overlaps, stays short
        cap = min(limits.direct_bucket_bytes, max(_TAPER_MIN, left // 2))
        full_ = (
            (not p.direct and -(-staged // 8) * 8 + p.nbytes > limits.bucket_bytes)
            or (p.direct and direct + p.nbytes > cap)
            or runs + p.count > limits.max_reads_per_bucket
            or (not p.direct and staging_device not in (None, p.device))
        )
        if current and full_:
            buckets.append(_bucket(len(buckets), current, cx))
            left -= direct
            current, staged, direct, runs, staging_device = [], 0, 0, 0, None
        if not p.direct:
            staging_device = p.device
        current.append(p)
        staged = staged if p.direct else -(-staged // 8) * 8 + p.nbytes
        direct += p.nbytes if p.direct else 0
        runs += p.count
    if current:
        buckets.append(_bucket(len(buckets), current, cx))
    total = sum(b.nbytes for b in buckets)
    return Plan(key=key, buckets=tuple(buckets), nbytes=total, ideal_bytes=ideal, seconds=time.perf_counter() - t0,
                copies=tuple(cs), digest_geometry=pub.digest_geometry(), target=target)  # fmt: skip


class PlanCache:
    """Plans by (publication layout, target layout, limits); a few kept, least recently used dropped."""

    def __init__(self, size: int = 4) -> None:
        self._plans: OrderedDict[Hashable, Plan] = OrderedDict()
        self._size = size
        self.hits = 0
        self.misses = 0
        self._target: Target | None = None

    def target(self, landing: Landing) -> Target:
        """What plans need of ``landing`` (built once: a receiver calls this in a worker thread as it starts)."""
        if self._target is None or self._target.landing is not landing:
            self._target = built(Target, landing)
        return self._target

    def key(self, pub: Publication, landing: Landing, limits: Limits) -> Hashable:
        return (pub.layout_key(), self.target(landing).key, limits)

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
        if self._target is None or self._target.landing is not landing:  # once per landing: off the loop
            await anyio.to_thread.run_sync(self.target, landing)
        key = self.key(pub, landing, limits)
        plan = self.lookup(key)
        if plan is None:
            plan = await anyio.to_thread.run_sync(build_plan, pub, landing, limits, key, self._target)
            self.store(plan)
        return plan


async def run(
    ctx: StageContext,
    cache: PlanCache,
    receive: ObjectReceiveStream[Publication],
    send: ObjectSendStream[Work],
) -> None:
    """Plan the publication, decide what a delta refit leaves and whom to read from, then send its buckets
    downstream in order."""
    async with receive, send:
        async for pub in receive:
            ctx.enter("plan")
            t0 = time.perf_counter()
            plan = await cache.get(pub, ctx.landing, ctx.limits)
            ctx.plan = plan
            ctx.digests = await anyio.to_thread.run_sync(built, digest_vector, pub)
            assert ctx.attempt is not None
            ctx.attempt.hold(plan.digest_geometry, ctx.digests)
            if ctx.limits.skip_unchanged:
                ctx.skips = await _skips(ctx, plan)
            if ctx.fanout is not None:
                await ctx.fanout.join(ctx)
            ctx.note("plan", len(plan.buckets), plan.nbytes, time.perf_counter() - t0)
            for bucket in plan.buckets:
                actions, recheck = ctx.skips.of(bucket.index) if ctx.skips is not None else (None, None)
                await send.send(Work(bucket, actions=actions, recheck=recheck))


async def _skips(ctx: StageContext, plan: Plan) -> Skips | None:
    """This refit's delta decision (None: every piece is pulled), the plan's index built on first use."""
    target, live = ctx.landing.holding("target"), ctx.landing.holding("live")
    if target is None and live is None:
        return None
    index = plan.derived.get("delta")
    if index is None:
        index = plan.derived["delta"] = await anyio.to_thread.run_sync(built, DeltaIndex, plan, ctx.landing)
    assert ctx.attempt is not None
    skips = decide(index, plan.digest_geometry, ctx.digests, target, live, turn=ctx.attempt.version,
                   recheck_fraction=ctx.limits.recheck_fraction)  # fmt: skip
    if skips is not None:
        ctx.counts.skipped = skips.skipped_bytes(index)
        ctx.counts.rechecked = skips.rechecked_bytes(index)
    return skips
