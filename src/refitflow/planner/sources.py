"""Which trainer rank each byte a receiver reads comes from.

*What a receiver reads, and from whose shards.*
A receiver with a layout reads a part of each canonical tensor (``Wanted``); a rank of a trillion-parameter
MoE model reads 1/16 of its 150,000 shards. ``held_in_layout`` finds a source's shards that meet those boxes
from the list of the trainer layout's entries this receiver reads, not by walking every shard. The layout is
built in part — of Megatron's per-expert entries, only the experts read (``rules.Only``) — and kept with the
receiver's ``Wanted`` with that list; the entries of no expert are the same on the ranks of one TP place (a
TP 8 × EP 32 trainer has 4 of each): their list is made once per place, and each of them is taken from one
of the place's ranks (``held_in_place``), not offered from all four. A layout built whole (no ``Only``)
is listed through an index by canonical tensor, sorted along dim 0. Every shard's name must be in its
layout; the shards read are checked against it.

*Among replicas* (``SourceLoad``): trainer ranks and replica sources (receivers serving a version they
committed) can hold the same whole tensor. A rank spreads its reads by load: each tensor goes to the candidate
with the least cost after taking it, where cost is the bytes this plan already reads from that source, and a
trainer's bytes count ``TRAINER_COST`` times. So with no replica a rank reads from the trainer ranks evenly,
and with replicas it leaves the trainer roughly 1/(1 + TRAINER_COST·R) of its bytes: the trainer's egress
stays about one model copy however many receivers refit, in waves. ``copies.copies`` applies both.

*Where among them a rank starts* (``place_of``): ranks of one engine read the same tensors in the same order.
Were ties broken alike in every plan, all of them would read the same replica at the same moment (a TP 32
engine's 32 ranks, one of a stage's 16 EP ranks holding its attention: that rank's links bound the refit).
A rank's *place* is where its slice lies in the model (rank r of n: r / n, read from its layout); ties among
k replicas start at the ``int(place · k)``-th and go round, so rank r reads replica (r·k/n + t) mod k at step t.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from refitflow.core.errors import ManifestError
from refitflow.core.types import ShardSpec
from refitflow.layouts.boxes import Box, full, intersect, volume
from refitflow.layouts.canonical import LocalTensor, Segment
from refitflow.layouts.rules import Common, Only
from refitflow.layouts.wire import resolve_only

__all__ = [
    "TRAINER_COST",
    "Source",
    "SourceLoad",
    "Wanted",
    "check_fits",
    "held_in_layout",
    "held_in_place",
    "meets",
    "place_of",
]

TRAINER_COST = 4.0


class Wanted:
    """What a receiver of ``layout`` reads of each canonical tensor (``boxes``: canonical -> its boxes; None:
    all of it), and the trainer layouts it met, each built in part with the list of its entries read
    (``held_in_layout``; the last ``keep`` layouts: a trainer of 256 ranks publishes 256)."""

    def __init__(self, layout: Mapping[str, LocalTensor], keep: int = 1024) -> None:
        out: dict[str, list[Box] | None] = {}
        for lt in layout.values():
            for seg in lt.segments:
                boxes = out.setdefault(seg.canonical, [])
                if boxes is not None:
                    whole = seg.shape is not None and seg.cbox == full(seg.shape)
                    out[seg.canonical] = None if whole else [*boxes, seg.cbox]
        self.boxes: dict[str, tuple[Box, ...] | None] = {c: None if bs is None else tuple(bs) for c, bs in out.items()}
        self._layouts: OrderedDict[str, _Resolved] = OrderedDict()
        self._keep = keep
        self._common: dict[tuple[object, ...], Common] = {}  # what layouts of one TP place share (``rules``)

    def resolved(self, text: str) -> _Resolved:
        """The layout ``metadata["layout"] == text`` describes, in the part this receiver reads, and its entries
        read."""
        found = self._layouts.get(text)
        if found is None:
            if len(self._common) > self._keep:  # the TP places of trainers seen (a few per trainer)
                self._common.clear()
            only = Only(self.boxes, common=self._common)
            layout = resolve_only(text, only)
            if only.used:  # built on a part shared with the layouts of its TP place: that part's entries read once
                common = only.used[0]
                if common.met is None:
                    common.met = _met_each(common.entries, self.boxes)
                found = _Resolved(only.names[0], _met_each(only.extra, self.boxes), common.met)
            else:
                found = _Resolved(frozenset(layout), _met(layout, self.boxes))
            self._layouts[text] = found
            if len(self._layouts) > self._keep:
                self._layouts.popitem(last=False)
        return found


def meets(boxes: tuple[Box, ...] | None, cbox: Box) -> bool:
    """Whether ``cbox`` meets one of ``boxes`` (None: the whole tensor is wanted; (): none of it)."""
    return boxes is None or any(intersect(box, cbox) is not None for box in boxes)


@dataclass(frozen=True, slots=True)
class _Sorted:
    """One canonical tensor's segments in a layout, by where they start along dim 0."""

    starts: list[int]
    stops: list[int] | None  # None: the stops do not grow with the starts (no bisection on them)
    entries: list[tuple[str, Segment]]  # (local name, segment)

    def meeting(self, box: Box) -> list[tuple[str, Segment]]:
        if not box:
            return self.entries
        lo, hi = box[0]
        first = bisect_right(self.stops, lo) if self.stops is not None else 0
        return self.entries[first : bisect_left(self.starts, hi)]


# a layout entry a receiver reads: (local name, the segment read, the entry)
_Met = list[tuple[str, Segment, LocalTensor]]


@dataclass(frozen=True, slots=True)
class _Resolved:
    """A trainer layout as a receiver reads it: every local name, the entries read (each segment once): its
    own, and those of the part it shares with the layouts of its TP place (one list for the place)."""

    names: frozenset[str]
    own: _Met
    shared: _Met | None = None

    @property
    def met(self) -> _Met:
        return [*(self.shared or ()), *self.own]


def _met(entries: Mapping[str, LocalTensor], wanted: Mapping[str, tuple[Box, ...] | None]) -> _Met:
    """The segments of ``entries`` that meet ``wanted`` (found through an index by canonical tensor, sorted
    along dim 0: a rank reads 1/16 of a stacked tensor's hundreds of per-expert boxes), each once."""
    out: _Met = []
    for canon, segs in _index(entries.items()).items():
        if canon not in wanted:
            continue
        boxes = wanted[canon]
        seen: set[tuple[str, Box]] = set()
        for box in (None,) if boxes is None else boxes:
            for name, seg in segs.entries if box is None else segs.meeting(box):
                if (name, seg.lbox) not in seen and meets(boxes, seg.cbox):
                    seen.add((name, seg.lbox))
                    out.append((name, seg, entries[name]))
    return out


def _met_each(entries: Mapping[str, LocalTensor], wanted: Mapping[str, tuple[Box, ...] | None]) -> _Met:
    """``_met`` of entries built in part (``rules.Only``: of the entries one per expert, those read only):
    each segment tried, no index."""
    get = wanted.get
    return [(name, seg, lt) for name, lt in entries.items() for seg in lt.segments
            if seg.canonical in wanted and meets(get(seg.canonical), seg.cbox)]  # fmt: skip


def _index(entries: Iterable[tuple[str, LocalTensor]]) -> dict[str, _Sorted]:
    """Layout entries' segments by canonical tensor, sorted along dim 0."""
    by: dict[str, list[tuple[str, Segment]]] = {}
    for name, lt in entries:
        for seg in lt.segments:
            by.setdefault(seg.canonical, []).append((name, seg))
    return {canon: _sorted(found) for canon, found in by.items()}


def _sorted(entries: list[tuple[str, Segment]]) -> _Sorted:
    entries.sort(key=lambda e: e[1].cbox[0] if e[1].cbox else (0, 1))
    starts = [e[1].cbox[0][0] if e[1].cbox else 0 for e in entries]
    stops = [e[1].cbox[0][1] if e[1].cbox else 1 for e in entries]
    return _Sorted(starts, stops if stops == sorted(stops) else None, entries)


def check_fits(spec: ShardSpec, local: LocalTensor | None, version: int) -> LocalTensor:
    """``local``, the layout's entry for ``spec``, when the shard is what it says (else ``ManifestError``)."""
    if local is None or spec.axis is not None or local.shape != spec.global_shape:
        raise ManifestError(f"shard does not match its layout ({local and local.shape} vs {spec.shape})",
                            tensor=spec.name, version=version)  # fmt: skip
    return local


Positions = Mapping[str, int]
# what a source adds: (its shards, each one's position by name, ``add(spec, segment)``)
Source = tuple[tuple[ShardSpec, ...], Positions, Callable[[ShardSpec, Segment], None]]


def held_in_layout(found: _Resolved, source: Source, version: int) -> None:
    """``add(spec, segment)`` for each of a source's shards (laid out as ``found``, ``Wanted.resolved``;
    positions: ``Manifest.positions``) and each of its segments in ``found.own``. Every shard's name must be in
    the layout; the shards added are checked against it (``check_fits``)."""
    shards, positions, add = source
    if not found.names.issuperset(positions):
        check_fits(next(s for s in shards if s.name not in found.names), None, version)
    for name, seg, local in found.own:
        p = positions.get(name)
        if p is not None:
            spec = shards[p]
            check_fits(spec, local, version)
            add(spec, seg)


def place_of(layout: Mapping[str, LocalTensor]) -> float:
    """Where a receiver's slice lies in the model, 0 <= place < 1: in the largest canonical tensor it reads a
    part of, where its box starts along the first axis it is cut on, over that axis (0: it reads whole
    tensors). Rank r of a TP n engine: r / n."""
    best: tuple[int, str] | None = None
    place = 0.0
    for lt in layout.values():
        for seg in lt.segments:
            shape = seg.shape
            if shape is None or not seg.cbox or seg.cbox == full(shape):
                continue
            size = (volume(full(shape)), seg.canonical)
            if best is None or size > best:
                axis = next(k for k, (a, b) in enumerate(seg.cbox) if (a, b) != (0, shape[k]))
                best, place = size, seg.cbox[axis][0] / shape[axis]
    return place


def held_in_place(shared: _Met, place: list[Source], version: int, at: float = 0.0) -> None:
    """The entries of a part the layouts of one TP place share (``found.shared``), each added from one of the
    place's sources: the one that has given the fewest bytes of them so far, ties from the receiver's place
    ``at`` (``place_of``) round (a TP 8 × EP 32 trainer holds each 4 times; choosing here, not among every
    copy later, is a quarter of the work). Checked as ``held_in_layout``."""
    n = len(place)
    load, start = [0] * n, int(at * n)
    last, pick, spec = "", -1, None
    for name, seg, local in shared:
        if name != last:  # (an entry's segments are listed together)
            last = name
            holders = [k for k, (_, positions, _) in enumerate(place) if name in positions]
            pick = min(holders, key=lambda k: (load[k], (k - start) % n), default=-1)
            if pick >= 0:
                shards, positions, _ = place[pick]
                spec = shards[positions[name]]
                check_fits(spec, local, version)
                load[pick] += spec.nbytes
        if pick >= 0:
            assert spec is not None
            place[pick][2](spec, seg)


class SourceLoad:
    """The bytes one plan reads from each source; ``trainers``: sources ``0..trainers-1`` are trainer ranks;
    ``place``: the receiver's (``place_of``), where among tied candidates it starts."""

    def __init__(self, trainers: int, place: float = 0.0) -> None:
        self.trainers = trainers
        self.place = place
        self.bytes: dict[int, int] = {}

    def choose(self, candidates: Sequence[tuple[int, ShardSpec]]) -> tuple[int, ShardSpec]:
        """The least loaded candidate after taking this tensor (ties: from the ``int(place · k)``-th of the k
        candidates round, in source order)."""
        got, trainers, count = self.bytes.get, self.trainers, len(candidates)
        start = int(self.place * count)
        best, least, size = candidates[0], (float("inf"), 0), 0
        for k, c in enumerate(candidates):  # (a plain loop: a layer norm of a TP 8 x EP 32 trainer has 32)
            n = c[1].nbytes
            cost = ((got(c[0], 0) + n) * (TRAINER_COST if c[0] < trainers else 1.0), (k - start) % count)
            if cost < least:
                best, least, size = c, cost, n
        self.bytes[best[0]] = got(best[0], 0) + size
        return best
