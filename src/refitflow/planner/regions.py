"""Regions: which boxes of one source shard to read for its copies, and how to cut them into pieces.

A region is a copy's own box, or a wider box when the copy's bytes could not be verified whole
(``verify="strict"``: widened to whole digest tiles, ``Tiling.aligned``), its runs are shorter than
``min_run_bytes`` (the enclosing rows of dim 0), or its whole rows cost fewer bytes than the read descriptors
they save (``descriptor_bytes`` a descriptor, at most ``max_row_factor`` times the box: ``_whole_rows``);
widened regions swallow the boxes they overlap (their bounding box, again aligned). ``chunks`` cuts a region
into pieces that are each one set of equally spaced runs (a strided read), at most a bucket and
``max_strided_runs`` runs, cut at tile edges where it can. A column slice stays as wide as it is (one
descriptor per row and slice, not per row and tile): verify gathers its xxh3 tiles in staging.
"""

from __future__ import annotations

from collections.abc import Iterator

from refitflow.core.digests import Tiling
from refitflow.layouts.boxes import Box, contiguous_span, full, intersect, run_count, run_length, strided, volume
from refitflow.planner.copies import Copy
from refitflow.planner.limits import Limits

__all__ = ["chunks", "regions"]


def _rows(shape: tuple[int, ...], lo: int, hi: int) -> Box:
    return ((lo, hi), *full(shape[1:])) if shape else ()


def _region_of(c: Copy, shape: tuple[int, ...], item: int, limits: Limits, tiling: Tiling) -> tuple[Box, bool]:
    """The box to read for one copy, and whether it was widened."""
    box = c.sbox
    if not shape:
        return box, False
    if limits.verify == "strict":
        wide = tiling.aligned(box)
    elif contiguous_span(box, shape) is None and run_length(box, shape) * item < limits.min_run_bytes:
        return _rows(shape, *box[0]), True
    else:
        wide = box
    wide = _whole_rows(wide, shape, item, limits) or wide
    return wide, wide != box


def _whole_rows(box: Box, shape: tuple[int, ...], item: int, limits: Limits) -> Box | None:
    """``box`` with its last dimension whole, when that adds fewer bytes than ``descriptor_bytes`` for each read
    descriptor it saves and reads at most ``max_row_factor`` times its bytes: a column slice of a row-parallel
    weight is a descriptor per row; its whole rows, one (Kimi-K2's ``o_proj`` at TP 16 of a TP 8 trainer: 7,168
    descriptors of 512 bytes, or one of 7.3 MB). The factor bounds what the sources serve: every receiver of a
    TP 32 engine reading a TP 1 trainer's whole ``o_proj`` is 32 copies of it from the trainer, where the
    trainer's links bound the refit. Tile-aligned as ``box`` is (the last dimension's tiles whole)."""
    if len(shape) < 2 or box[-1] == (0, shape[-1]) or not limits.descriptor_bytes:
        return None
    rows = (*box[:-1], (0, shape[-1]))
    saved = run_count(box, shape) - run_count(rows, shape)
    extra = (volume(rows) - volume(box)) * item
    if volume(rows) > limits.max_row_factor * volume(box):
        return None
    return rows if saved > 0 and extra <= saved * limits.descriptor_bytes else None


def _hull(a: Box, b: Box) -> Box:
    return tuple((min(x0, y0), max(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b, strict=True))


def regions(
    cs: list[Copy], shape: tuple[int, ...], item: int, limits: Limits, tiling: Tiling
) -> list[tuple[Box, list[Copy]]]:
    """Group one shard's copies (digest geometry ``tiling``) into regions; a widened region swallows what
    it overlaps."""
    if len(cs) == 1:
        return [(_region_of(cs[0], shape, item, limits, tiling)[0], cs)]
    out: list[tuple[Box, bool, list[Copy]]] = []
    items = ((*_region_of(c, shape, item, limits, tiling), c) for c in cs)
    for box, widened, c in sorted(items, key=lambda x: x[0]):
        members = [c]
        hit = True
        while hit:  # the hull may reach further regions
            hit = False
            for r in out:
                if (r[1] or widened) and intersect(r[0], box) is not None:
                    out.remove(r)
                    box = _hull(r[0], box)
                    box = tiling.aligned(box) if limits.verify == "strict" else box
                    widened, members, hit = True, r[2] + members, True
                    break
        out.append((box, widened, members))
    return [(b, m) for b, _, m in sorted(out, key=lambda r: r[0])]


def chunks(
    box: Box, shape: tuple[int, ...], item: int, cap: int, max_runs: int, grid: tuple[int, ...] | None = None
) -> Iterator[Box]:
    """Cut ``box`` into boxes of at most ``cap`` bytes and ``max_runs`` equally spaced runs each.

    Cuts go along the outermost dimension that has more than one index, as few as fit; ``grid``:
    per dimension, the multiple a cut falls on when a piece holds more than one (digest tiles);
    a cut inside a row falls on an 8-byte word.
    """
    if not shape:
        yield box
        return
    runs = strided(box, shape)
    if runs is not None and volume(box) * item <= cap and runs[3] <= max_runs:
        yield box
        return
    d = next(k for k, (s, e) in enumerate(box) if e - s > 1)
    lo, hi = box[d]

    def slab(a: int, b: int) -> Box:
        return (*box[:d], (a, b), *box[d + 1 :])

    one = strided(slab(lo, lo + 1), shape)
    unit = volume(slab(lo, lo + 1)) * item
    if one is None or unit > cap or one[3] > max_runs:  # one index along d is too much: cut deeper
        for s in range(lo, hi):
            yield from chunks(slab(s, s + 1), shape, item, cap, max_runs, grid)
        return
    step = cap // unit
    two = strided(slab(lo, lo + 2), shape)
    if two is None:
        step = 1
    elif two[3] > one[3]:  # more indices along d, more runs
        step = min(step, max_runs // one[3])
    g = grid[d] if grid else 1
    if step >= g:
        step -= step % g
    if d == len(shape) - 1:  # inside a row: whole 8-byte words
        w = max(1, 8 // item)
        step = max(w, step - step % w)
    for s in range(lo, hi, step):
        yield slab(s, min(hi, s + step))
