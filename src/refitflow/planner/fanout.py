"""Fan-out as the planner sees it: what this rank would hold for others as a relay, and where an upstream
relay holds each piece this rank reads.

*Held boxes* (``held_boxes``): a plan's box copies are exactly what this rank will hold of each trainer
shard — the copies into tensors of the shard's own dtype (no cast, no float8) are what it can serve as a
relay (``core.fanout``). Their layout digest names this rank's layout to the registry.

*Geometry* (``Geometry``): for one relay layout, where the relay holds each piece of this plan. A piece
is relayable when the relay's held boxes of its trainer shard tile its box into parts that are each one
contiguous run of the piece (row-major) and one strided read of the relay's tensor; the bytes then land
exactly as the trainer's read would land them, and verify checks them against the trainer's digests.
Pieces with digest units split across pieces are never relayed (a relay's bad bytes are then re-read
within their own bucket). Built once per (plan, relay layout).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import numpy as np

from refitflow.core.dtypes import itemsize
from refitflow.core.fanout import HeldBox, RelayOffer, RelayParam, relay_layout
from refitflow.core.threads import breathe, building
from refitflow.layouts.boxes import contiguous_span, full, intersect, shape_of, shift, strided, volume
from refitflow.planner.reads import runs_read
from refitflow.planner.records import Piece, Plan, PlannedRead

__all__ = ["RELAY", "Geometry", "RelayPiece", "geometry", "held_boxes"]

RELAY = -1  # the source index of a read from the upstream relay (its region: the relay's tensor index)


Held = tuple[tuple[HeldBox, ...], str]  # what a rank holds of the trainer shards, and its relay layout digest


def held_boxes(plan: Plan) -> Held:
    """What this rank holds of each trainer shard in the shard's dtype, and the layout digest (cached per plan)."""
    cached = plan.derived.get("held")
    if not isinstance(cached, tuple):
        with building():  # tens of thousands of acyclic objects: no collector passes over the heap
            cached = plan.derived["held"] = _held_boxes(plan)
    return cached


def _held_boxes(plan: Plan) -> Held:
    position, dtypes = plan.receiver.position, plan.receiver.dtypes
    assembled = plan.route.assembled
    held = tuple(
        HeldBox(c.source, c.spec.name, c.sbox, position[c.param], c.dbox)
        for c in plan.copies
        if c.param not in assembled and dtypes[c.param] == c.spec.dtype
    )
    return held, relay_layout(plan.receiver.relay_params, held)


@dataclass(frozen=True, slots=True)
class RelayPiece:
    """How one piece is read from the relay: its reads (source ``RELAY``, region = the relay's tensor
    index) and the relay tensors whose progress it waits for."""

    piece: int
    reads: tuple[PlannedRead, ...]
    params: np.ndarray


class Geometry:
    """Per bucket of a plan, the pieces one relay layout holds (``RelayPiece``), in piece order."""

    def __init__(self, plan: Plan, offer: RelayOffer) -> None:
        index: dict[tuple[int, str], list[HeldBox]] = {}
        for h in offer.held:
            index.setdefault((h.rank, h.tensor), []).append(h)
        self.buckets: list[dict[int, RelayPiece]] = []
        for b in plan.buckets:
            breathe()
            ch = b.checks
            split = {s.land for s in ch.streams} | {
                m.land for m in ch.mixes if (m.check & (m.covered < m.total)).any()
            }  # units completed across pieces: never relayed
            per: dict[int, RelayPiece] = {}
            for k, p in enumerate(b.pieces):
                if k not in split:
                    found = _relayed(k, p, index.get((p.source, p.tensor), ()), offer.params)
                    if found is not None:
                        per[k] = found
            self.buckets.append(per)


def _relayed(k: int, p: Piece, held: Sequence[HeldBox], params: tuple[RelayParam, ...]) -> RelayPiece | None:
    box, item = p.box, itemsize(p.src_dtype)
    shape = shape_of(box)
    parts = []
    for h in held:
        if len(h.sbox) != len(box):
            continue
        common = intersect(box, h.sbox)
        if common is None:
            continue
        span = contiguous_span(shift(common, box, full(shape)), shape)
        try:
            rbox = shift(common, h.sbox, h.dbox)
        except ValueError:
            return None
        runs = strided(rbox, params[h.param].shape)
        if span is None or runs is None:
            return None
        parts.append((span[0], span[1], h.param, runs))
    parts.sort()
    if sum(n for _, n, _, _ in parts) != volume(box) or any(a[0] + a[1] > b[0] for a, b in pairwise(parts)):
        return None  # the relay does not hold all of it (or holds it twice)
    param = p.scatters[0].param if p.direct else None
    reads = tuple(
        runs_read(RELAY, t, first * item, run * item, stride * item, count, param, p.landing_offset + at * item)
        for at, _, t, (first, run, stride, count) in parts
    )
    return RelayPiece(k, reads, np.unique(np.array([t for _, _, t, _ in parts], dtype=np.int64)))


def geometry(plan: Plan, offer: RelayOffer) -> Geometry:
    """The geometry of ``offer``'s layout for ``plan`` (cached per plan)."""
    key = ("relay", offer.layout)
    cached = plan.derived.get(key)
    if not isinstance(cached, Geometry):
        with building():
            cached = plan.derived[key] = Geometry(plan, offer)
    return cached
