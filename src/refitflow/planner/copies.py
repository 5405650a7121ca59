"""Intersect the receiver's segments with the publication's, in canonical space, into box copies.

Every publisher shard becomes segments of canonical tensors: from its layout (``metadata["layout"]``)
or, without one, the trivial layout (the shard is ``tensor[start:stop]`` along ``axis``). Identical
boxes held by several sources are replicas: one is chosen, spread across sources. Distinct boxes
that overlap, boxes that leave a gap in what the receiver needs, or shapes that disagree are a
``PlanError``; a destination parameter nothing is published for is a ``CoverageError``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from refitflow.core.errors import ConfigError, CoverageError, ManifestError, PlanError
from refitflow.core.types import Publication, ShardSpec
from refitflow.layouts.boxes import Box, full, intersect, shape_of, shift, volume
from refitflow.layouts.canonical import LocalTensor, Segment, sliced
from refitflow.layouts.quant import QuantFormat, declared_quant
from refitflow.layouts.quant_layout import with_scales
from refitflow.layouts.wire import resolve
from refitflow.layouts.wire import shapes as layout_shapes
from refitflow.planner.sources import Source, SourceLoad, Wanted, check_fits, held_in_layout, held_in_place, meets

__all__ = ["Copy", "Held", "Published", "copies", "published"]


@dataclass(slots=True, unsafe_hash=True)  # a plan record: see planner/records.py
class Held:
    """A canonical box one source holds, and where in which of its shards."""

    source: int
    spec: ShardSpec
    segment: Segment


@dataclass(slots=True, unsafe_hash=True)  # a plan record: see planner/records.py
class Copy:
    """``source.spec[sbox]`` → ``param[dbox]`` (same elements; ranks may differ by leading 1-dims)."""

    source: int
    spec: ShardSpec
    sbox: Box
    param: str
    dbox: Box


@dataclass(frozen=True, slots=True)
class Published:
    """A publication in canonical space: the boxes its sources hold (replicas resolved), each canonical
    tensor's shape and the quantised ones' formats (canonical values name -> format)."""

    held: dict[str, list[Held]]
    shapes: dict[str, tuple[int, ...]]
    quant: dict[str, QuantFormat]
    rows_only: frozenset[int] = frozenset()  # sources whose digests cover whole rows only (no column ranges)


def published(pub: Publication, aliases: Mapping[str, str], wanted: Wanted | None = None, at: float = 0.0) -> Published:
    """``pub`` in canonical space. ``wanted``: the boxes the receiver reads (``Wanted``; a receiver with
    a layout): boxes that meet none of them are neither kept nor checked for overlaps — a rank of a
    trillion-parameter model reads 1/16 of 150,000 shards; the shards read are checked against their layout.
    ``at``: the receiver's place (``sources.place_of``): where among replicas its reads start.
    Nothing is left out when a manifest declares a quantised tensor (its scales are canonical tensors too)."""
    held: dict[str, dict[Box, list[Held]]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    axes: dict[str, int | None] = {}
    quant: dict[str, QuantFormat] = {}
    rows_only = frozenset(i for i, m in enumerate(pub.manifests) if m.metadata.get("digests") == "rows")
    if any(m.metadata.get("quant") for m in pub.manifests):
        wanted = None
    # through the layouts' indexes: the shards read only; what a TP place's layouts share, from one of its ranks
    found = {i: wanted.resolved(m.metadata["layout"]) for i, m in enumerate(pub.manifests)
             if "layout" in m.metadata and wanted is not None}  # fmt: skip
    places: dict[int, list[int]] = {}
    for i, f in found.items():
        if f.shared is not None:
            places.setdefault(id(f.shared), []).append(i)
    for i, m in enumerate(pub.manifests):  # trainer ranks
        if i in found:
            shapes |= layout_shapes(m.metadata["layout"])
            f = found[i]
            place = places.get(id(f.shared), ()) if f.shared is not None else ()
            if place and place[0] == i:
                held_in_place(f.shared or [], [_source(pub, k, held) for k in place], pub.version, at)
            held_in_layout(f, _source(pub, i, held), pub.version)
            continue
        layout, canon_shapes = resolve(m.metadata["layout"]) if "layout" in m.metadata else (None, {})
        declared = declared_quant(m.metadata.get("quant"), pub.version)
        if layout is not None and declared:
            try:
                layout, canon_shapes = with_scales(layout, declared, canon_shapes)
            except ConfigError as exc:
                raise ManifestError(str(exc), version=pub.version) from None
        for name, fmt in declared.items():
            for seg in layout[name].segments if layout is not None else ():
                quant[seg.canonical] = fmt
            if layout is None:
                quant[aliases.get(name, name)] = fmt
        shapes |= canon_shapes
        if layout is not None:
            _from_layout(i, m.shards, layout, held, pub.version)
            continue
        for spec in m.shards:
            canon = aliases.get(spec.name, spec.name)
            local = sliced(canon, spec.global_shape, spec.axis, spec.start, spec.stop)
            axis = axes.setdefault(canon, spec.axis)
            if axis != spec.axis and None not in (axis, spec.axis):
                raise PlanError(
                    f"axis mismatch: shards of {canon} split on axis {spec.axis} and axis {axis}",
                    tensor=spec.name, version=pub.version,
                )  # fmt: skip
            if shapes.setdefault(canon, spec.global_shape) != spec.global_shape:
                raise PlanError(
                    f"shards disagree on the shape: {spec.global_shape} vs {shapes[canon]}",
                    tensor=spec.name, version=pub.version,
                )  # fmt: skip
            for seg in local.segments:
                if wanted is None or meets(wanted.boxes.get(seg.canonical, ()), seg.cbox):
                    held.setdefault(seg.canonical, {}).setdefault(seg.cbox, []).append(Held(i, spec, seg))
    out: dict[str, list[Held]] = {}
    load = SourceLoad(trainers=len(pub.manifests), place=at)
    for canon in sorted(held):
        boxes = held[canon]
        out[canon] = [_choose(reps, load) for reps in boxes.values()]
        if len(boxes) > 1:
            _check_overlap(canon, list(boxes), pub.version)
    return Published(out, shapes, quant, rows_only)


def _adder(held: dict[str, dict[Box, list[Held]]], i: int) -> Callable[[ShardSpec, Segment], None]:
    def add(spec: ShardSpec, seg: Segment) -> None:
        held.setdefault(seg.canonical, {}).setdefault(seg.cbox, []).append(Held(i, spec, seg))

    return add


def _source(pub: Publication, i: int, held: dict[str, dict[Box, list[Held]]]) -> Source:
    m = pub.manifests[i]
    return m.shards, m.positions, _adder(held, i)


def _from_layout(i: int, shards: tuple[ShardSpec, ...], layout: Mapping[str, LocalTensor],
                 held: dict[str, dict[Box, list[Held]]], version: int) -> None:  # fmt: skip
    """Source ``i``'s shards through its layout into ``held``, each checked against it."""
    get, add = layout.get, _adder(held, i)
    for spec in shards:
        for seg in check_fits(spec, get(spec.name), version).segments:
            add(spec, seg)


def _choose(reps: list[Held], load: SourceLoad) -> Held:
    """One of the sources holding the same box: the least loaded (trainer bytes weigh more)."""
    if len(reps) == 1:
        return reps[0]
    source, _ = load.choose([(h.source, h.spec) for h in reps])
    return next(h for h in reps if h.source == source)


def _check_overlap(canon: str, boxes: list[Box], version: int) -> None:
    """Distinct boxes must not meet: a sweep along dim 0 compares only boxes whose rows overlap
    (hundreds of per-expert boxes of one stacked tensor would otherwise be compared pairwise)."""
    active: list[Box] = []  # boxes whose dim-0 range reaches the current one's start
    for box in sorted(boxes, key=lambda b: b[0] if b else (0, 1)):
        if box:
            active = [a for a in active if a[0][1] > box[0][0]]
        for other in active:
            common = intersect(other, box)
            if common is not None:
                axis = next((k for k, (x, y) in enumerate(common) if (x, y) != (0, 0)), 0)
                diff = [k for k in range(len(common)) if other[k] != box[k]]
                axis = diff[0] if diff else axis
                lo, hi = common[axis]
                raise PlanError(f"overlapping shards on axis {axis} at [{lo}, {hi})", tensor=canon, version=version)
        active.append(box)


def _check_whole_rows(cs: list[Copy], rows_only: frozenset[int], version: int) -> None:
    """A source that digested whole rows only cannot verify a column slice: refuse before anything is read."""
    for c in cs:
        shape = c.spec.shape
        if c.source in rows_only and len(shape) >= 2 and c.sbox[-1] != (0, shape[-1]):
            a, b = c.sbox[-1]
            raise PlanError(
                f"this rank reads columns {a}:{b} of {shape[-1]}, but the trainer digested whole rows only "
                "(Publisher(column_digests=False)): it could not verify them; publish with column digests "
                "(the default) for receivers that slice columns", tensor=c.spec.name, version=version,
            )  # fmt: skip


def _gap(canon: str, need: Box, got: list[Box], version: int) -> PlanError:
    """Name the gap along the one axis the boxes differ on, else count the missing elements."""
    axes = {k for b in got for k in range(len(need)) if b[k] != need[k]}
    if len(axes) <= 1:
        axis = axes.pop() if axes else 0
        pos, lo_need, hi_need = need[axis][0], need[axis][0], need[axis][1]
        for b in sorted(got, key=lambda b: b[axis][0]):
            if b[axis][0] > pos:
                break
            pos = max(pos, b[axis][1])
        end = min((b[axis][0] for b in got if b[axis][0] > pos), default=hi_need)
        if lo_need <= pos < hi_need:
            return PlanError(f"coverage gap in {canon} axis {axis} [{pos}, {end})", tensor=canon, version=version)
    missing = volume(need) - sum(volume(b) for b in got)
    return PlanError(
        f"coverage gap in {canon}: {missing} elements of {need} not published", tensor=canon, version=version
    )


def copies(pub: Publication, found: Published, dest: Mapping[str, LocalTensor], exact: bool) -> list[Copy]:
    """Every box copy the receiver needs, in destination order; every check done before returning.

    ``found``: ``published(pub, ...)``; ``exact``: the receiver holds whole tensors (trivial layout), so shapes
    must match exactly and every published name must be one of its parameters.
    """
    held, shapes = found.held, found.shapes
    needed = {seg.canonical for lt in dest.values() for seg in lt.segments}
    # a receiver of whole tensors must know every published name; one with a layout holds a part of the
    # model (a pipeline stage, a rank whose vocabulary rows are all padding) and needs only its own
    unknown = sorted(n for n in held if n not in needed) if exact else ()
    if unknown:
        raise PlanError(f"the model has no parameter named {unknown[:20]}", version=pub.version)
    if not needed <= held.keys():
        missing = sorted(p for p, lt in dest.items() if any(s.canonical not in held for s in lt.segments))
        raise CoverageError("the publication does not cover every parameter", missing=missing, version=pub.version)
    out: list[Copy] = []
    gaps: list[PlanError] = []
    for param, lt in dest.items():
        for seg in lt.segments:
            pshape = shapes[seg.canonical]
            fits = seg.cbox == full(pshape) or (
                len(pshape) == len(seg.cbox) and all(e <= d for (_, e), d in zip(seg.cbox, pshape, strict=True))
            )
            model = seg.shape if seg.shape is not None else (shape_of(seg.cbox) if exact else None)
            if not fits or (model is not None and tuple(model) != tuple(pshape)):  # wider or narrower: never in part
                raise PlanError(
                    f"shape mismatch: publication {pshape}, model {model or lt.shape}",
                    tensor=seg.canonical, version=pub.version,
                )  # fmt: skip
            got = []
            for h in held[seg.canonical]:
                if h.segment.cbox == seg.cbox:  # the same box on both sides (most tensors): nothing to cut
                    got.append(seg.cbox)
                    out.append(Copy(h.source, h.spec, h.segment.lbox, param, seg.lbox))
                    continue
                common = intersect(seg.cbox, h.segment.cbox)
                if common is None:
                    continue
                got.append(common)
                out.append(Copy(h.source, h.spec, shift(common, h.segment.cbox, h.segment.lbox), param,
                                shift(common, seg.cbox, seg.lbox)))  # fmt: skip
            if (len(got) != 1 or got[0] != seg.cbox) and sum(volume(b) for b in got) != volume(seg.cbox):
                gaps.append(_gap(seg.canonical, seg.cbox, got, pub.version))
    if found.rows_only:
        _check_whole_rows(out, found.rows_only, pub.version)
    if gaps:  # every gap, before anything is pulled
        more = f" (and {len(gaps) - 20} more)" if len(gaps) > 20 else ""
        text = "; ".join(g.reason for g in gaps[:20]) + more
        raise PlanError(text, tensor=gaps[0].tensor, version=pub.version)
    return out
