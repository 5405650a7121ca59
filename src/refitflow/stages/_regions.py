"""Regions: which boxes of one source shard to read for its copies, and how to cut them into pieces.

A region is a copy's own box, or the enclosing rows of dim 0 when the copy's bytes could not be
verified whole (``verify="strict"``: widened to the digest blocks) or its runs are shorter than
``min_run_bytes``; widened regions swallow the boxes they overlap. ``chunks`` cuts a region into
boxes of at most a bucket and ``max_strided_runs`` contiguous runs.
"""

from __future__ import annotations

from collections.abc import Iterator

from refitflow.layouts.boxes import Box, contiguous_span, full, intersect, run_count, run_length, volume
from refitflow.stages._context import Limits
from refitflow.stages._segments import Copy

__all__ = ["chunks", "regions"]


def _rows(box: Box, shape: tuple[int, ...], lo: int, hi: int) -> Box:
    return ((lo, hi), *full(shape[1:])) if shape else ()


def _region_of(c: Copy, shape: tuple[int, ...], item: int, limits: Limits) -> tuple[Box, bool]:
    """The box to read for one copy, and whether it was widened to whole rows."""
    box = c.sbox
    if not shape:
        return box, False
    spec = c.spec
    if limits.verify == "strict":
        br = spec.block_rows or spec.rows
        lo, hi = box[0]
        aligned = box[1:] == full(shape[1:]) and lo % br == 0 and (hi % br == 0 or hi == shape[0])
        if aligned:
            return box, False
        return _rows(box, shape, lo // br * br, min(shape[0], -(-hi // br) * br)), True
    if contiguous_span(box, shape) is None and run_length(box, shape) * item < limits.min_run_bytes:
        return _rows(box, shape, *box[0]), True
    return box, False


def regions(cs: list[Copy], shape: tuple[int, ...], item: int, limits: Limits) -> list[tuple[Box, list[Copy]]]:
    """Group one shard's copies into regions; widened (whole-row) regions swallow what they overlap."""
    items = sorted(((*_region_of(c, shape, item, limits), c) for c in cs), key=lambda x: x[0][0] if x[0] else (0, 0))
    out: list[list] = []  # [box, widened, members]
    for box, widened, c in items:
        last = out[-1] if out else None
        if last is not None and (last[1] or widened) and box and box[0][0] < last[0][0][1] and intersect(last[0], box):
            last[0] = _rows(box, shape, min(last[0][0][0], box[0][0]), max(last[0][0][1], box[0][1]))
            last[1] = True
            last[2].append(c)
        else:
            out.append([box, widened, [c]])
    return [(b, m) for b, _, m in out]


def chunks(box: Box, shape: tuple[int, ...], item: int, cap: int, max_runs: int) -> Iterator[Box]:
    """Cut ``box`` into boxes of at most ``cap`` bytes and ``max_runs`` contiguous runs each."""
    if volume(box) * item <= cap and run_count(box, shape) <= max_runs:
        yield box
        return
    d = next(k for k, (s, e) in enumerate(box) if e - s > 1)
    one = (*box[:d], (box[d][0], box[d][0] + 1), *box[d + 1 :])
    step = min(cap // max(volume(one) * item, 1), max_runs // run_count(one, shape))
    lo, hi = box[d]
    if step >= 1:
        for s in range(lo, hi, step):
            yield (*box[:d], (s, min(hi, s + step)), *box[d + 1 :])
    else:
        for s in range(lo, hi):
            yield from chunks((*box[:d], (s, s + 1), *box[d + 1 :]), shape, item, cap, max_runs)
