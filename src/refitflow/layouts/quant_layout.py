"""How a quantised tensor's scales follow its values through layouts: boxes of values to boxes of scales
(``aligned_scale_box``, ``cover``), a values layout to its scales' (``scale_layout``, ``global_layout``),
elements to NVFP4's packed bytes (``to_stored``), and a publisher's layout and ``metadata["quant"]``
(``with_scales``, ``quant_metadata``). The formats themselves: ``layouts/quant.py``."""

from __future__ import annotations

from collections.abc import Mapping

import orjson
import torch

from refitflow.core.dtypes import dtype_name
from refitflow.core.errors import ConfigError
from refitflow.layouts.boxes import Box
from refitflow.layouts.canonical import LocalTensor, Segment
from refitflow.layouts.quant import QuantFormat, detect
from refitflow.layouts.wire import resolve

__all__ = [
    "aligned_scale_box",
    "cover",
    "global_layout",
    "quant_metadata",
    "scale_layout",
    "stored_box",
    "to_stored",
    "with_scales",
]


def aligned_scale_box(fmt: QuantFormat, box: Box, shape: tuple[int, ...]) -> Box | None:
    """The box of scales that exactly covers the values ``box`` of a tensor of ``shape`` (stored units), or
    None when the box cuts a block (its edges are not on the block grid, the tensor's own end aside)."""
    *lead, rows, cols = box
    (br, bc), pv = fmt.block, fmt.per_value
    out = list(lead)
    for (a, b), blk, n, mult in ((rows, br, shape[-2], 1), (cols, bc, shape[-1], pv)):
        if not blk:
            out.append((0, 1))
            continue
        a, b, n = a * mult, b * mult, n * mult
        if a % blk or (b % blk and b != n):
            return None
        out.append((a // blk, -(-b // blk)))
    return tuple(out)


def cover(fmt: QuantFormat, box: Box, shape: tuple[int, ...]) -> Box:
    """The smallest box on the block grid that holds ``box`` (clipped to ``shape``)."""
    *lead, rows, cols = box
    (br, bc), pv = fmt.block, fmt.per_value
    out = list(lead)
    for (a, b), blk, n, mult in ((rows, br, shape[-2], 1), (cols, bc, shape[-1], pv)):
        if not blk:
            out.append((0, n))
            continue
        step = blk // mult if blk % mult == 0 else blk
        out.append((a // step * step, min(-(-b // step) * step, n)))
    return tuple(out)


def scale_layout(fmt: QuantFormat, lt: LocalTensor, shapes: Mapping[str, tuple[int, ...]]) -> LocalTensor | None:
    """The layout of a quantised local tensor's scales, from its values' layout ``lt`` (each segment's
    canonical tensor's scales, ``canonical + scale_suffix``); None when a segment cuts a block on either side
    (``shapes``: the canonical tensors' shapes)."""
    segments = []
    for seg in lt.segments:
        cshape = seg.shape or shapes[seg.canonical]
        cbox = aligned_scale_box(fmt, seg.cbox, cshape)
        lbox = aligned_scale_box(fmt, seg.lbox, lt.shape)
        if cbox is None or lbox is None:
            return None
        segments.append(Segment(seg.canonical + fmt.scale_suffix, cbox, lbox, fmt.scale_shape(cshape)))
    return LocalTensor(fmt.scale_shape(lt.shape), tuple(segments))


def global_layout(fmt: QuantFormat, lt: LocalTensor, shapes: Mapping[str, tuple[int, ...]]) -> LocalTensor | None:
    """The layout of a quantised local tensor's global scale (``canonical + global_suffix``, one per leading
    index): None when the local tensor holds more than one canonical tensor in one leading index (a fused
    parameter: one global scale cannot hold two)."""
    assert fmt.global_suffix is not None
    if len(lt.segments) != 1:
        return None
    seg = lt.segments[0]
    cshape = seg.shape or shapes[seg.canonical]
    return LocalTensor(
        fmt.global_shape(lt.shape),
        (Segment(seg.canonical + fmt.global_suffix, seg.cbox[:-2], seg.lbox[:-2], fmt.global_shape(cshape)),),
    )


def stored_box(box: Box, pv: int) -> Box | None:
    """A box in elements in stored units (``pv`` elements a stored value); None when it splits one."""
    a, b = box[-1]
    return None if a % pv or b % pv else (*box[:-1], (a // pv, b // pv))


def to_stored(fmt: QuantFormat, lt: LocalTensor) -> LocalTensor | None:
    """A layout in elements (what layouts describe) in the values' stored units (NVFP4: two elements a byte);
    None when a box splits a byte."""
    pv = fmt.per_value
    if pv == 1:
        return lt
    segments = []
    for seg in lt.segments:
        cbox, lbox = stored_box(seg.cbox, pv), stored_box(seg.lbox, pv)
        if cbox is None or lbox is None or (seg.shape is not None and seg.shape[-1] % pv):
            return None
        shape = None if seg.shape is None else (*seg.shape[:-1], seg.shape[-1] // pv)
        segments.append(Segment(seg.canonical, cbox, lbox, shape))
    return LocalTensor((*lt.shape[:-1], lt.shape[-1] // pv), tuple(segments))


def with_scales(
    layout: Mapping[str, LocalTensor], quant: Mapping[str, QuantFormat], shapes: Mapping[str, tuple[int, ...]]
) -> tuple[dict[str, LocalTensor], dict[str, tuple[int, ...]]]:
    """A publisher's layout (in elements) with its quantised tensors (``quant``: published name -> format) in
    stored units and their scales' and global scales' entries added; the canonical shapes likewise.
    ``ConfigError`` when a quantised tensor's layout cuts its blocks (the publisher cannot say which scale
    covers the cut block)."""
    out, canon = dict(layout), dict(shapes)
    for name, fmt in quant.items():
        lt = layout.get(name)
        stored = None if lt is None else to_stored(fmt, lt)
        if stored is None:
            raise ConfigError(f"{name!r} is published {fmt.name} but its layout has no entry in whole bytes for it")
        for seg in stored.segments:
            was = shapes[seg.canonical]
            cshape = canon[seg.canonical] = (*was[:-1], was[-1] // fmt.per_value)
            canon[seg.canonical + fmt.scale_suffix] = fmt.scale_shape(cshape)
            if fmt.global_suffix:
                canon[seg.canonical + fmt.global_suffix] = fmt.global_shape(cshape)
        scales = scale_layout(fmt, stored, canon)
        if scales is None:
            raise ConfigError(f"{name!r} is published {fmt.name} but its layout cuts its {fmt.block} blocks")
        out[name], out[name + fmt.scale_suffix] = stored, scales
        if fmt.global_suffix:
            g = global_layout(fmt, stored, canon)
            if g is None:
                raise ConfigError(f"{name!r} is published {fmt.name}: one global scale cannot cover its segments")
            out[name + fmt.global_suffix] = g
    return out, canon


def quant_metadata(
    tensors: Mapping[str, torch.Tensor], declared: Mapping[str, str] | None, metadata: Mapping[str, str]
) -> dict[str, str]:
    """A publisher's ``metadata["quant"]`` for its quantised tensors (none: no entry); ``ConfigError`` for scales
    stored other than as published (SGLang's packed UE8M0: publish ``fp8_block128_pow2``), or a layout that
    cuts a quantised tensor's blocks."""
    found = detect(tensors, declared, strict=False)
    if not found:
        return {}
    for name, q in found.items():
        if q.format.storage != "canonical":
            want = (dtype_name(q.format.scale), q.format.scale_shape(tuple(tensors[name].shape)))
            raise ConfigError(
                f"{name!r}: {q.format.name} is how a receiver stores {q.format.same}; publish its scales as "
                f"{q.format.same} does ({want[0]}, {want[1]})"
            )
    if "layout" in metadata:
        layout, shapes = resolve(metadata["layout"])
        with_scales(layout, {n: q.format for n, q in found.items()}, shapes)
    return {"quant": orjson.dumps({n: q.format.name for n, q in found.items()}, option=orjson.OPT_SORT_KEYS).decode()}
