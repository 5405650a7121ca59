"""Route: how each destination parameter of a plan is written, given what is published quantised.

- **plain**: the bytes land as they are (or cast), box by box.
- **copy**: a quantised parameter whose publication is the same format, every block whole on both sides: its
  values and scales are read like any tensors (the scales' boxes follow from the values': ``scale_layout``).
- **quantise**: a quantised parameter published unquantised: assembled in float32, quantised at commit in the
  parameter's format. The quantised destination is the request (nothing else asks for it).
- **convert**: anything else a quantised publication meets. Each of the parameter's segments is read whole
  blocks at a time (values, scales, global scale) into auxiliary assemblies (``"param\\0v<i>"`` ...), and
  at commit either copied (the same numbers, scales stored otherwise: SGLang's packed UE8M0) or dequantised
  exactly, then cast (an unquantised parameter) or quantised again — which loses information, so it needs
  ``lossy_casts`` and is otherwise a ``PlanError`` naming the tensor and why.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from refitflow.core.dtypes import dtype_from_name
from refitflow.core.errors import PlanError
from refitflow.layouts.boxes import Box, full, shape_of, volume
from refitflow.layouts.canonical import LocalTensor, Segment
from refitflow.layouts.quant import QuantFormat, QuantParam
from refitflow.layouts.quant_layout import (
    aligned_scale_box,
    cover,
    global_layout,
    scale_layout,
    stored_box,
    to_stored,
)
from refitflow.planner.copies import Published

__all__ = ["Job", "Part", "Route", "aux_name", "aux_owner", "build_route", "default_route"]

AUX = "\0"  # separates a parameter's name from its auxiliary assembly's part (aux_name)


@dataclass(frozen=True, slots=True)
class Part:
    """One segment of a converted parameter: the auxiliary assemblies holding its blocks."""

    canonical: str
    values: str
    scale: str | None  # None: the segment is published unquantised
    global_: str | None
    fmt: QuantFormat | None
    cover: Box  # the canonical box (stored units) the assemblies hold: whole blocks around ``cbox``
    cbox: Box  # the segment's canonical box, in elements
    lbox: Box  # where it goes in the parameter, in elements


@dataclass(frozen=True, slots=True)
class Job:
    """What commit does once every assembly a parameter needs is complete."""

    param: str
    quant: QuantParam | None  # the parameter's own format (None: not quantised)
    needs: tuple[tuple[str, int], ...]  # assembly name -> elements it receives
    parts: tuple[Part, ...] = ()  # convert (empty: quantise the parameter's float32 assembly)
    exact: bool = False  # convert without re-quantising: the same numbers, scales re-stored


@dataclass(frozen=True)
class Route:
    layout: Mapping[str, LocalTensor]  # what plans map the publication onto (assemblies included)
    assembled: frozenset[str] = frozenset()  # names whose scatters land in an assembly
    aux: Mapping[str, torch.Tensor] = field(default_factory=dict)  # auxiliary assembly -> a meta tensor like it
    jobs: Mapping[str, Job] = field(default_factory=dict)  # assembly name -> the job it feeds
    converted: frozenset[str] = frozenset()  # parameters written by a convert job (credited when it runs)
    units: Mapping[str, int] = field(default_factory=dict)  # copied packed parameters: elements per stored value


def default_route(layout: Mapping[str, LocalTensor], quantised: Mapping[str, QuantParam],
                  expected: Mapping[str, int]) -> Route:  # fmt: skip
    """Nothing published quantised: every quantised parameter of ``layout`` is quantised at commit."""
    jobs = {p: Job(p, q, ((p, expected[p]),)) for p, q in quantised.items() if p in layout}
    return Route(layout, frozenset(jobs), jobs=jobs)


def build_route(found: Published, base: Mapping[str, LocalTensor], quantised: Mapping[str, QuantParam],
                expected: Mapping[str, int], dtypes: Mapping[str, torch.dtype], lossy: bool,
                version: int) -> Route:  # fmt: skip
    """The route of one publication (``base``: the receiver's layout, in elements, scales left out; ``quantised``,
    ``expected``, ``dtypes``: the receiver layout's)."""
    if not found.quant:
        return default_route(base, quantised, expected)
    layout = dict(base)
    jobs: dict[str, Job] = {}
    aux: dict[str, torch.Tensor] = {}
    converted: set[str] = set()
    units: dict[str, int] = {}
    for param, lt in base.items():
        srcs = [found.quant.get(seg.canonical) for seg in lt.segments]
        mine = quantised.get(param)
        if not any(srcs):
            if mine is not None:
                jobs[param] = Job(param, mine, ((param, expected[param]),))
            continue
        if mine is not None and _copy(mine, lt, srcs, found, layout):
            if mine.format.per_value > 1:
                units[param] = mine.format.per_value
            continue
        job = _convert(param, lt, srcs, mine, dtypes[param], found, aux, layout, lossy, version)
        del layout[param]  # read into its auxiliary assemblies instead
        converted.add(param)
        jobs |= dict.fromkeys((n for n, _ in job.needs), job)
    return Route(layout, frozenset(jobs), aux, jobs, frozenset(converted), units)


def _copy(mine: QuantParam, lt: LocalTensor, srcs: list, found: Published, layout: dict) -> bool:
    """Route ``mine`` as plain copies of values and scales when every segment allows it (layout updated)."""
    fmt = mine.format
    if any(s is None or s.name != fmt.name for s in srcs):
        return False
    stored = to_stored(fmt, lt)
    scales = None if stored is None else scale_layout(fmt, stored, found.shapes)
    if stored is None or scales is None or sum(volume(s.lbox) for s in scales.segments) != volume(full(scales.shape)):
        return False
    glob = None
    if mine.global_ is not None:
        glob = global_layout(fmt, stored, found.shapes)
        if glob is None:
            return False
    layout[mine.values], layout[mine.scale] = stored, scales
    if glob is not None:
        assert mine.global_ is not None
        layout[mine.global_] = glob
    return True


def _convert(param: str, lt: LocalTensor, srcs: list, mine: QuantParam | None, dtype: torch.dtype,
             found: Published, aux: dict[str, torch.Tensor], layout: dict[str, LocalTensor], lossy: bool,
             version: int) -> Job:  # fmt: skip
    """The convert job of ``param``; its auxiliary assemblies' meta tensors and layouts added to ``aux`` and
    ``layout``."""
    if mine is None and not dtype.is_floating_point:
        raise PlanError(f"{param} is {dtype} and is published quantised: it cannot be dequantised into it "
                        "(a quantised parameter needs its scales beside it: layouts/quant.py)",
                        tensor=param, version=version)  # fmt: skip
    parts, needs = [], []
    why = ""  # why the numbers cannot be kept as they are ("": they can)
    for i, (seg, fmt) in enumerate(zip(lt.segments, srcs, strict=True)):
        cshape = found.shapes[seg.canonical]  # stored units
        if fmt is None:
            why = why or f"{seg.canonical} is published unquantised beside quantised parts"
            box = seg.cbox
            held = dtype_from_name(found.held[seg.canonical][0].spec.dtype, tensor=seg.canonical)
        else:
            stored = stored_box(seg.cbox, fmt.per_value)
            if stored is None:
                raise PlanError(f"{param} takes {seg.cbox} of {seg.canonical}, which splits its packed bytes",
                                tensor=param, version=version)  # fmt: skip
            box = cover(fmt, stored, cshape)
            held = fmt.values
            if mine is None:  # dequantised exactly: nothing is lost
                pass
            elif fmt.same != mine.format.same:
                why = why or f"{seg.canonical} is published {fmt.name} and {param} is {mine.format.name}"
            elif fmt.per_value != 1:
                why = why or f"{param} cannot take {fmt.name}'s packed values as they are"
            elif box != stored or aligned_scale_box(fmt, seg.lbox, lt.shape) is None:
                why = why or f"{param} takes {_text(seg.cbox)} of {seg.canonical}, which cuts its {fmt.block} blocks"
        name = _whole(aux_name(param, "v", i), seg.canonical, box, held, found, aux, layout)
        scale = glob = None
        if fmt is not None:
            sbox = aligned_scale_box(fmt, box, cshape)
            assert sbox is not None  # a cover is on the block grid
            scale = _whole(aux_name(param, "s", i), seg.canonical + fmt.scale_suffix, sbox, fmt.scale, found, aux,
                           layout)  # fmt: skip
            if fmt.global_suffix is not None:
                glob = _whole(aux_name(param, "g", i), seg.canonical + fmt.global_suffix, box[:-2], torch.float32,
                              found, aux, layout)  # fmt: skip
        parts.append(Part(seg.canonical, name, scale, glob, fmt, box, seg.cbox, seg.lbox))
        needs += [(n, aux[n].numel()) for n in (name, scale, glob) if n is not None]
    exact = mine is not None and not why
    if exact and mine is not None and mine.global_ is not None and len(parts) > 1:
        exact, why = False, why or f"one global scale of {param} cannot hold its {len(parts)} parts' own"
    if mine is not None and not exact and not lossy:
        raise PlanError(
            f"{why}: landing it means quantising again, which loses information and lossy_casts is off "
            f"(publish it unquantised, or as {mine.format.name} in whole blocks, or set lossy_casts=True)",
            tensor=param, version=version,
        )  # fmt: skip
    return Job(param, mine, tuple(needs), tuple(parts), exact)


def _whole(name: str, canonical: str, cbox: Box, dtype: torch.dtype, found: Published,
           aux: dict[str, torch.Tensor], layout: dict[str, LocalTensor]) -> str:  # fmt: skip
    """An auxiliary assembly ``name`` holding ``canonical[cbox]`` whole: its meta tensor and its layout."""
    shape = shape_of(cbox)
    aux[name] = torch.empty(shape, dtype=dtype, device="meta")
    layout[name] = LocalTensor(shape, (Segment(canonical, cbox, full(shape), found.shapes[canonical]),))
    return name


def aux_name(param: str, kind: str, part: int) -> str:
    """The name of an auxiliary assembly of ``param`` (never a parameter's: it holds a NUL)."""
    return f"{param}{AUX}{kind}{part}"


def aux_owner(name: str) -> str:
    """The parameter an auxiliary assembly belongs to (a parameter's own name for a parameter)."""
    return name.split(AUX, 1)[0]


def _text(box: Box) -> str:
    return "[" + ", ".join(f"{a}:{b}" for a, b in box) + "]"
