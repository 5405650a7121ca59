"""Build a plan: map a publication onto a receiver's parameters as buckets of reads.

A plan is data, independent of the bytes: it is computed once per (publication layout, receiver
layout, limits) and replayed for every later version with the same layout. Every check that can
fail (unknown name or dtype, shape mismatch, overlapping or missing shards, a cast nobody asked for)
fails here, as ``PlanError`` or ``CoverageError``, before any byte is written.

The box copies come from ``copies`` (receiver segments ∩ publisher segments in canonical space, each
box from the source ``sources`` chooses); the pieces each shard is read as from ``pieces`` (regions and
chunks: ``regions``); the records from ``records``. (The compile filter, ``compile_filter``, runs in
discover, before begin.) Pieces fill buckets in order; a staged piece is laid out in its bucket's staging at
an 8-byte aligned offset, and reads that continue each other merge (``reads``).

Each bucket also carries what verify and commit need (``checks``), so a replayed plan does no per-tensor
planning work at all; a new plan's are made on first use (``Bucket.built``: the refit's plan stage makes
them a millisecond's worth at a time as it hands the buckets on, so the first read does not wait for them).
Building runs in a worker thread that lets the event loop take the GIL every half millisecond. What plans
need of the destination itself is the ``ReceiverLayout``, built once per destination.
"""

from __future__ import annotations

import time
from collections.abc import Hashable
from dataclasses import replace

from refitflow.core.errors import PlanError
from refitflow.core.threads import breathe, built
from refitflow.core.types import Publication
from refitflow.layouts.boxes import Box, volume
from refitflow.planner.checks import Checks, Credits, DigestIndex, Land, build_checks, build_credits
from refitflow.planner.copies import copies, published
from refitflow.planner.limits import Limits
from refitflow.planner.pieces import shard_pieces
from refitflow.planner.reads import coalesce, piece_read
from refitflow.planner.receiver_layout import Params, ReceiverLayout
from refitflow.planner.records import Bucket, Piece, Plan, Scatter
from refitflow.planner.routes import Route, aux_owner, build_route

__all__ = ["box_index", "build_plan"]


# the taper's floor: each bucket costs a read's fixed cost (a worker-thread hop, NIXL's post and completion,
# ≈ 0.5–1 ms) and verify's hop; below 16 MiB that cost more than the shorter last verification saved
# (docs/benchmarks.md, "The taper's floor")
_TAPER_MIN = 16 << 20


def box_index(box: Box) -> tuple[slice, ...]:
    return tuple(slice(s, e) for s, e in box)


class _Context:
    """What every bucket of one plan shares: the digest index, the receiver layout, the boxes seen."""

    def __init__(self, pub: Publication, receiver: ReceiverLayout, route: Route) -> None:
        self.index = DigestIndex(pub)
        self.receiver = receiver
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
    seen, place, device_of, assembled = cx.seen, cx.index.place, cx.receiver.device_of, cx.route.assembled
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
    """What verify and commit need of one bucket (``planner.checks``)."""
    checks = build_checks(
        ((p.source, p.tensor, p.box, Land(p.scatters[0].param if p.direct else None, p.landing_offset, p.nbytes))
         for p in laid),
        cx.index,
    )  # fmt: skip
    route = cx.route  # auxiliary assemblies are credited to their parameter when it is converted
    credits = build_credits(((s.param, s.dbox) for p in laid for s in p.scatters if s.param not in route.aux),
                            cx.receiver.position, cx.receiver.names, route.units)  # fmt: skip
    return checks, credits


def build_plan(pub: Publication, receiver: ReceiverLayout | Params, limits: Limits, key: Hashable = None) -> Plan:
    """Every read the receiver needs of ``pub``, grouped into buckets of at most the limits' sizes (``receiver``:
    its layout, or the destination to read one from); ``key``: the caller's cache key, kept in the plan."""
    layout = receiver if isinstance(receiver, ReceiverLayout) else ReceiverLayout(receiver)
    return built(_build, pub, layout, limits, key)


def _build(pub: Publication, receiver: ReceiverLayout, limits: Limits, key: Hashable) -> Plan:
    t0 = time.perf_counter()
    found = published(pub, receiver.canonical, receiver.wanted, receiver.place)
    route = receiver.route
    if found.quant:  # something is published quantised: route each parameter (planner/routes.py)
        route = build_route(found, receiver.layout, receiver.quantised, receiver.expected, receiver.torch_dtype,
                            limits.lossy_casts, pub.version)  # fmt: skip
    cx = _Context(pub, receiver, route)
    buckets: list[Bucket] = []
    current: list[Piece] = []
    staged = direct = runs = ideal = 0
    staging_device = None  # a bucket stages on one device: a staged piece for another starts a new bucket
    cs = copies(pub, found, route.layout, receiver.exact)
    # direct batches grow past ``direct_bucket_bytes`` for a slice that would fill more than max_direct_buckets
    batch = max(limits.direct_bucket_bytes, -(-receiver.nbytes // limits.max_direct_buckets))
    pieces = list(shard_pieces(cs, receiver, replace(limits, direct_bucket_bytes=batch), route))
    # a rank starts at its place in the model (``sources.place_of``: rank r of TP n at r / n): the ranks of an
    # engine read different layers, so different pipeline stages of the trainer, at once; ``read_start`` moves
    # every rank of an engine on (engines spread). Relays chain ranks of one layout only, so one place, one order.
    start = (limits.read_start + receiver.place) % 1.0
    if start:
        pieces = _rotated(pieces, start)
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
    geometry = cx.index.seal()
    return Plan(key=key, buckets=tuple(buckets), nbytes=total, ideal_bytes=ideal, seconds=time.perf_counter() - t0,
                copies=tuple(cs), digest_geometry=geometry, digest_order=tuple(cx.index.order),
                digest_count=cx.index.count, digest_runs=cx.index.runs, receiver=receiver, route=route)  # fmt: skip


def _rotated(pieces: list[Piece], start: float) -> list[Piece]:
    """``pieces`` from the first shard that begins at ``start`` of their bytes or after and cuts no parameter,
    wrapping round (a shard's pieces stay together; the last batches still taper). A parameter cut by the wrap
    would be whole only at the plan's end: a relay marks whole parameters verified, and its readers, in the same
    order, would wait for that end from their first bucket on. Unrotated when no such cut exists."""
    owners = [{aux_owner(sc.param) for sc in p.scatters} for p in pieces]
    last = {q: i for i, ps in enumerate(owners) for q in ps}  # where each parameter's last piece is
    begin, at, reach = start * sum(p.nbytes for p in pieces), 0, -1  # reach: the last piece of any begun
    for i, p in enumerate(pieces):
        new_shard = i == 0 or (p.source, p.tensor) != (pieces[i - 1].source, pieces[i - 1].tensor)
        if at >= begin and reach < i and new_shard:
            return pieces[i:] + pieces[:i]
        reach = max(reach, *(last[q] for q in owners[i]), i)
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
