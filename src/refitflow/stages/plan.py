"""Plan: map a complete publication onto this rank's parameters as buckets of reads.

A plan is data, independent of the bytes: it is computed once per (publication layout, target
layout, limits) and replayed for every later version with the same layout. Every check that can
fail (unknown name or dtype, shape mismatch, overlapping or missing shards, a cast nobody asked for)
fails here, as ``PlanError`` or ``CoverageError``, before any byte is written.

The box copies come from ``_segments`` (receiver segments ∩ publisher segments in canonical space);
the pieces each shard is read as from ``_pieces`` (regions and chunks: ``_regions``); the records from
``_records``. (The compile filter, ``_filter``, runs in discover, before begin.) Pieces fill buckets in
order; a staged piece is laid out in its bucket's staging at an 8-byte aligned offset, and reads that
continue each other merge (``_reads``).

Each bucket also carries what verify and commit need (``_checks``), so a replayed plan does no
per-tensor planning work at all; a new plan's are made as the plan stage hands its buckets on, a
millisecond's worth at a time, so the first read does not wait for them. Both run in a worker thread that
lets the event loop take the GIL every half millisecond. What plans need of the landing
itself is built once per landing (``_target``: a receiver builds it as it starts).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import replace

from anyio.abc import ObjectReceiveStream, ObjectSendStream

from refitflow.core.errors import PlanError
from refitflow.core.gil import breathe, built, off_loop
from refitflow.core.types import Publication
from refitflow.layouts.boxes import Box, volume
from refitflow.stages._checks import Checks, Credits, DigestIndex, Land, build_checks, build_credits
from refitflow.stages._context import Landing, Limits, StageContext, Work
from refitflow.stages._delta import DeltaIndex, Skips, decide
from refitflow.stages._filter import check_compile
from refitflow.stages._pieces import check_cast, shard_pieces
from refitflow.stages._reads import coalesce, piece_read
from refitflow.stages._records import Bucket, Piece, Plan, PlannedRead, Scatter
from refitflow.stages._route import Route, build_route
from refitflow.stages._segments import copies, published
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


# the taper's floor: each bucket costs a read's fixed cost (a worker-thread hop, NIXL's post and completion,
# ≈ 0.5–1 ms) and verify's hop; below 16 MiB that cost more than the shorter last verification saved
# (docs/benchmarks.md, "The taper's floor")
_TAPER_MIN = 16 << 20


def box_index(box: Box) -> tuple[slice, ...]:
    return tuple(slice(s, e) for s, e in box)


class _Context:
    """What every bucket of one plan shares: the digest index, the landing's ``Target``, the boxes seen."""

    def __init__(self, pub: Publication, target: Target, route: Route) -> None:
        self.index = DigestIndex(pub)
        self.target = target
        self.route = route
        self.seen: set[tuple[str, Box]] = set()


def _bucket(index: int, pieces: list[Piece], cx: _Context) -> Bucket:
    """Lay staged pieces out one after another (8-byte aligned), coalesce adjacent reads; the checks are
    made on first use (``_checks_of``), each piece's digests placed in the plan's vector now. One pass over
    the pieces (a ~3 T model's rank has 16,000 in 3,000 buckets)."""
    laid: list[Piece] = []
    staged_pieces: list[Piece] = []
    scatters: list[Scatter] = []
    touched: set[str] = set()
    staged = direct = pulled = 0
    seen, place, device_of, assembled = cx.seen, cx.index.place, cx.target.device_of, cx.route.assembled
    for p in pieces:
        breathe()
        if p.direct:
            direct += p.nbytes
        else:
            staged = -(-staged // 8) * 8
            p = replace(p, landing_offset=staged)
            staged += p.nbytes
            staged_pieces.append(p)
        laid.append(p)
        pulled += p.nbytes
        touched.add(p.device)
        place(p.source, p.tensor)  # its place in the digest vector, in plan order
        for s in p.scatters:
            key = (s.param, s.dbox)
            if key in seen:
                raise PlanError(f"box {s.dbox} of {s.param} would be written twice", tensor=s.param)
            seen.add(key)
            scatters.append(s)
            touched.add(device_of(s.param))
    laid_ = tuple(laid)
    return Bucket(
        index, laid_, tuple(coalesce([piece_read(p) for p in laid])), staging_bytes=-(-staged // 8) * 8,
        direct_bytes=direct, device=staged_pieces[0].device if staged_pieces else laid[0].device,
        devices=tuple(sorted(touched, key=lambda d: (d != "cpu", d))), staged=tuple(staged_pieces),
        make=lambda: _checks_of(laid_, cx), derived=tuple(s for s in scatters if s.param in assembled),
        pulled_bytes=pulled,
    )  # fmt: skip


def _checks_of(laid: tuple[Piece, ...], cx: _Context) -> tuple[Checks, Credits]:
    """What verify and commit need of one bucket (``stages._checks``)."""
    checks = build_checks(
        ((p.source, p.tensor, p.box, Land(p.scatters[0].param if p.direct else None, p.landing_offset, p.nbytes))
         for p in laid),
        cx.index,
    )  # fmt: skip
    route = cx.route  # auxiliary assemblies are credited to their parameter when it is converted
    credits = build_credits(((s.param, s.dbox) for p in laid for s in p.scatters if s.param not in route.aux),
                            cx.target.position, cx.target.names, route.units)  # fmt: skip
    return checks, credits


def build_plan(
    pub: Publication, landing: Landing, limits: Limits, key: Hashable = None, target: Target | None = None
) -> Plan:
    """Every read this rank needs, grouped into buckets of at most the limits' sizes (``target``: the
    landing's, when the caller keeps it)."""
    return built(_build, pub, Target.of(landing, target), limits, key)


def _build(pub: Publication, target: Target, limits: Limits, key: Hashable) -> Plan:
    t0 = time.perf_counter()
    found = published(pub, target.landing.canonical, target.wanted)
    route = target.route
    if found.quant:  # something is published quantised: route each parameter (stages/_route.py)
        route = build_route(found, target.layout, target.landing, limits.lossy_casts, pub.version)
    cx = _Context(pub, target, route)
    buckets: list[Bucket] = []
    current: list[Piece] = []
    staged = direct = runs = ideal = 0
    staging_device = None  # a bucket stages on one device: a staged piece for another starts a new bucket
    cs = copies(pub, found, route.layout, target.exact)
    # direct batches grow past ``direct_bucket_bytes`` for a slice that would fill more than max_direct_buckets
    batch = max(limits.direct_bucket_bytes, -(-target.nbytes // limits.max_direct_buckets))
    pieces = list(shard_pieces(cs, target, replace(limits, direct_bucket_bytes=batch), route))
    if limits.read_start:
        pieces = _rotated(pieces, limits.read_start)
    left = sum(p.nbytes for p in pieces if p.direct)  # direct bytes not yet in a bucket
    whole = _shard_bytes(pieces)
    for p, shard in zip(pieces, whole, strict=True):
        ideal += sum(volume(s.sub) for s in p.scatters) * (p.nbytes // max(volume(p.box), 1))
        # the last direct buckets taper (half of what is left, at least 16 MiB): the last bucket's
        # verification, which nothing overlaps, stays short. A shard's direct pieces that fit in one bucket
        # go in one (``shard``: their bytes, at its first piece): a shard cut by a bucket is two reads
        cap = min(batch, max(_TAPER_MIN, left // 2))
        full_ = (
            (not p.direct and -(-staged // 8) * 8 + p.nbytes > limits.bucket_bytes)
            or (p.direct and direct + (shard if 0 < shard <= cap else p.nbytes) > cap)
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
    cx.seen.clear()  # the buckets keep ``cx`` to make their checks: what they need of it alone
    return Plan(key=key, buckets=tuple(buckets), nbytes=total, ideal_bytes=ideal, seconds=time.perf_counter() - t0,
                copies=tuple(cs), digest_geometry=cx.index.seal(), digest_order=tuple(cx.index.order),
                digest_count=cx.index.count, target=target, route=route)  # fmt: skip


def _rotated(pieces: list[Piece], start: float) -> list[Piece]:
    """``pieces`` from the first shard that begins at ``start`` of their bytes or after, wrapping round (a
    shard's pieces stay together; the last batches still taper)."""
    target, at = start * sum(p.nbytes for p in pieces), 0
    for i, p in enumerate(pieces):
        if at >= target and (i == 0 or (p.source, p.tensor) != (pieces[i - 1].source, pieces[i - 1].tensor)):
            return pieces[i:] + pieces[:i]
        at += p.nbytes
    return pieces


def _shard_bytes(pieces: list[Piece]) -> list[int]:
    """Per piece, the bytes of the run of direct pieces of its shard it starts (0 inside a run, or staged)."""
    out = [0] * len(pieces)
    start, prev = -1, None
    for i, p in enumerate(pieces):
        key = (p.source, p.tensor) if p.direct else None
        if key is None or key != prev:
            start = i
        if key is not None:
            out[start] += p.nbytes
        prev = key
    return out


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
            await off_loop(self.target, landing)
        key = self.key(pub, landing, limits)
        plan = self.lookup(key)
        if plan is None:
            plan = await off_loop(build_plan, pub, landing, limits, key, self._target)
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
            if not pub.pending:  # else verify takes the digests when they follow (nothing skipped, no relays)
                ctx.digests = await off_loop(plan.digests, pub)
                assert ctx.attempt is not None
                ctx.attempt.hold(plan.digest_geometry, ctx.digests)
                if ctx.limits.skip_unchanged:
                    ctx.skips = await _skips(ctx, plan)
                if ctx.fanout is not None:
                    await ctx.fanout.join(ctx)
            ctx.note("plan", len(plan.buckets), plan.nbytes, time.perf_counter() - t0)
            for bucket in plan.buckets:
                if not bucket.is_built:  # a new plan: its checks are made as its buckets go, the first read
                    await off_loop(_build_ahead, plan.buckets, bucket.index)
                actions, recheck = ctx.skips.of(bucket.index) if ctx.skips is not None else (None, None)
                await send.send(Work(bucket, actions=actions, recheck=recheck))


def _build_ahead(buckets: tuple[Bucket, ...], first: int) -> None:
    """The checks of ``buckets[first]`` and of those after it, for about a millisecond (a hop each)."""
    t0 = time.perf_counter()
    for b in buckets[first:]:
        b.built()
        if time.perf_counter() - t0 > 0.001:
            break


async def _skips(ctx: StageContext, plan: Plan) -> Skips | None:
    """This refit's delta decision (None: every piece is pulled), the plan's index built on first use."""
    target, live = ctx.landing.holding("target"), ctx.landing.holding("live")
    if target is None and live is None:
        return None
    index = plan.derived.get("delta")
    if index is None:
        index = plan.derived["delta"] = await off_loop(DeltaIndex, plan, ctx.landing)
    assert ctx.attempt is not None
    skips = decide(index, plan.digest_geometry, ctx.digests, target, live, turn=ctx.attempt.version,
                   recheck_fraction=ctx.limits.recheck_fraction)  # fmt: skip
    if skips is not None:
        ctx.counts.skipped = skips.skipped_bytes(index)
        ctx.counts.rechecked = skips.rechecked_bytes(index)
    return skips
