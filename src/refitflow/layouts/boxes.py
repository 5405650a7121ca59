"""Boxes: per-dimension half-open ranges ``((start, stop), ...)`` of a row-major tensor, and their algebra.

Plans call these per tensor, and a model's boxes repeat from layer to layer: the pure ones are
memoised (arguments are tuples).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache

_memo = lru_cache(maxsize=1 << 14)

__all__ = [
    "Box",
    "contiguous_span",
    "full",
    "intersect",
    "row_runs",
    "run_count",
    "run_length",
    "shape_of",
    "shift",
    "strided",
    "volume",
]

Box = tuple[tuple[int, int], ...]


def full(shape: Sequence[int]) -> Box:
    return _full(tuple(shape))


@_memo
def _full(shape: tuple[int, ...]) -> Box:
    return tuple([(0, int(d)) for d in shape])


@_memo
def shape_of(box: Box) -> tuple[int, ...]:
    return tuple([b - a for a, b in box])


@_memo
def volume(box: Box) -> int:
    n = 1
    for a, b in box:
        n *= b - a
    return n


@_memo
def intersect(a: Box, b: Box) -> Box | None:
    """The common part of two boxes of the same rank, or None when they do not meet."""
    if len(a) != len(b):
        raise ValueError(f"boxes of different ranks: {a} and {b}")
    out = []
    for (x0, x1), (y0, y1) in zip(a, b, strict=True):
        lo, hi = (x0 if x0 > y0 else y0), (x1 if x1 < y1 else y1)
        if lo >= hi:
            return None
        out.append((lo, hi))
    return tuple(out)


@_memo
def shift(box: Box, old_origin: Box, new_origin: Box) -> Box:
    """Move ``box`` (inside ``old_origin``) to the same place relative to ``new_origin``.

    The ranks may differ by leading size-1 dimensions (dropped from, or taken from ``new_origin``).
    """
    k = len(old_origin) - len(new_origin)
    head: Box = ()
    if k < 0:
        head, new_origin = new_origin[:-k], new_origin[-k:]
        k = 0
    if any(e - s != 1 for s, e in (*box[:k], *head)):
        raise ValueError(f"cannot map box {box} of {old_origin} onto {new_origin}")
    return head + tuple(
        (n0 + s - o0, n0 + e - o0) for (s, e), (o0, _), (n0, _) in zip(box[k:], old_origin[k:], new_origin, strict=True)
    )


def _strides(shape: Sequence[int]) -> list[int]:
    return [math.prod(shape[k + 1 :]) for k in range(len(shape))]


@_memo
def contiguous_span(box: Box, shape: Sequence[int]) -> tuple[int, int] | None:
    """(first element, element count) when ``box`` is one contiguous run of a row-major ``shape``."""
    n = len(shape)
    d = n  # the first dimension from which every later one is full
    while d > 0 and box[d - 1] == (0, shape[d - 1]):
        d -= 1
    if any(e - s != 1 for s, e in box[: max(d - 1, 0)]):
        return None
    start = sum(s * st for (s, _), st in zip(box, _strides(shape), strict=True))
    return start, volume(box)


def run_count(box: Box, shape: Sequence[int]) -> int:
    """How many contiguous runs ``box`` is made of (see ``row_runs``)."""
    d = len(shape)
    while d > 0 and box[d - 1] == (0, shape[d - 1]):
        d -= 1
    return 1 if d <= 1 else math.prod(e - s for s, e in box[: d - 1])


def run_length(box: Box, shape: Sequence[int]) -> int:
    """Elements per contiguous run of ``box`` (see ``row_runs``)."""
    d = len(shape)
    while d > 0 and box[d - 1] == (0, shape[d - 1]):
        d -= 1
    return volume(box) if d <= 1 else (box[d - 1][1] - box[d - 1][0]) * math.prod(shape[d:])


def row_runs(box: Box, shape: Sequence[int]) -> list[tuple[int, int]]:
    """The contiguous runs (first element, element count) that make up ``box``, in row-major order."""
    n = len(shape)
    d = n
    while d > 0 and box[d - 1] == (0, shape[d - 1]):
        d -= 1
    if d <= 1:
        span = contiguous_span(box, shape)
        assert span is not None
        return [span]
    strides = _strides(shape)
    run = (box[d - 1][1] - box[d - 1][0]) * strides[d - 1]
    outer = box[: d - 1]
    runs = []
    for idx in _indices(outer):
        base = sum(i * st for i, st in zip(idx, strides, strict=False)) + box[d - 1][0] * strides[d - 1]
        runs.append((base, run))
    return runs


def _indices(box: Box) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = [()]
    for s, e in box:
        out = [(*o, i) for o in out for i in range(s, e)]
    return out


@_memo
def strided(box: Box, shape: Sequence[int]) -> tuple[int, int, int, int] | None:
    """``box`` as equally spaced runs ``(first element, elements per run, stride, count)``, or None.

    One run (``count == 1``, stride 0) when ``box`` is contiguous; None when its runs are not
    equally spaced (two or more partial outer dimensions that are not one contiguous range).
    """
    n = len(shape)
    d = n
    while d > 0 and box[d - 1] == (0, shape[d - 1]):
        d -= 1
    strides = _strides(shape)
    first = sum(s * st for (s, _), st in zip(box, strides, strict=True))
    if d <= 1:
        return first, volume(box), 0, 1
    run = (box[d - 1][1] - box[d - 1][0]) * strides[d - 1]
    outer = box[: d - 1]
    wide = [k for k, (s, e) in enumerate(outer) if e - s > 1]
    if not wide:
        return first, run, 0, 1
    if len(wide) == 1:
        k = wide[0]
        return first, run, strides[k], outer[k][1] - outer[k][0]
    if contiguous_span(outer, shape[: d - 1]) is None:
        return None
    return first, run, strides[d - 2], volume(outer)
