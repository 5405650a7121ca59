"""Digests of shard bytes, computed where the bytes are: two algorithms over one tile geometry.

**Geometry** (``Tiling``). A shard of shape ``(..., M, C)`` is ``P`` planes (the product of its
leading dims) of ``M`` rows × ``C`` columns; a 1-D shard is one row, a scalar one row of one
column. Rows are cut into blocks of ``tile_rows``, columns into ranges of ``tile_cols``; a *tile* is
one block × one column range of one plane. Digests are listed tile by tile in (plane, block,
column range) order; under xxh3, when a block has several rows and several column ranges (its
tiles are strided in memory), one digest per row block follows, in (plane, block) order, so a
reader of whole rows hashes contiguous bytes. ``tile_rows == 0``: one digest covers the shard.

Why tiles: a tensor-parallel receiver of a row-parallel weight (``o_proj``, ``down_proj``) reads a
column slice, and with row blocks alone it had to read whole rows to verify them (1.9–2× its
slice). TP degrees are powers of two up to 8, so the publisher cuts columns into 8 equal,
word-aligned ranges when a row is wide enough: every TP m → n slice, m, n ∈ {1, 2, 4, 8}, is then
whole tiles (``choose_tiling``).

The two algorithms (``xxh3``, ``mix64``) and the hashing itself: ``core/hashing.py``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

__all__ = [
    "ALGORITHMS",
    "Tiling",
    "Unit",
    "Units",
    "choose_tiling",
    "frame",
    "unit_count",
    "units_array",
    "units_of",
]

ALGORITHMS = ("xxh3", "mix64")
TILE_ROWS = 64  # rows per block, fewer when they exceed MAX_TILE_BYTES
MAX_TILE_BYTES = 4 << 20
COLUMN_PARTS = 8  # TP degrees up to 8 slice columns at multiples of C/8
MIN_COLUMN_BYTES = 128  # narrower column ranges are not worth their digests

Box = tuple[tuple[int, int], ...]


class Tiling:
    """The digest geometry of one shard (see the module docstring)."""

    __slots__ = ("algo", "cols", "item", "nc", "nr", "planes", "row_digests", "rows", "shape", "tile_cols",
                 "tile_rows", "tiles")  # fmt: skip

    def __init__(self, algo: str, shape: Sequence[int], item: int, tile_rows: int, tile_cols: int) -> None:
        if algo not in ALGORITHMS:
            raise ValueError(f"unknown digest algorithm {algo!r}; known: {list(ALGORITHMS)}")
        self.algo, self.shape, self.item = algo, tuple(shape), item
        self.planes = math.prod(self.shape[:-2])
        self.rows = self.shape[-2] if len(self.shape) >= 2 else 1
        self.cols = self.shape[-1] if self.shape else 1
        self.tile_rows, self.tile_cols = tile_rows, tile_cols
        if tile_rows == 0:  # one digest for the whole shard
            self.nr = self.nc = self.tiles = 1
            self.row_digests = False
            return
        if not (1 <= tile_rows <= max(self.rows, 1) and 1 <= tile_cols <= max(self.cols, 1)):
            raise ValueError(f"tile {tile_rows}×{tile_cols} does not fit a {self.rows}×{self.cols} shard")
        self.nr = -(-self.rows // tile_rows)
        self.nc = -(-self.cols // tile_cols)
        if self.nc > 1 and (tile_cols * item) % 8:
            raise ValueError(f"column ranges of {tile_cols * item} bytes are not whole 8-byte words")
        self.tiles = self.planes * self.nr * self.nc
        self.row_digests = algo == "xxh3" and self.nc > 1 and min(tile_rows, self.rows) > 1

    @property
    def count(self) -> int:
        """How many digests the shard has."""
        return self.tiles + (self.planes * self.nr if self.row_digests else 0)

    @property
    def box(self) -> Box:
        """The whole shard, as a box."""
        return tuple((0, d) for d in self.shape)

    @property
    def row_bytes(self) -> int:
        return self.cols * self.item

    @property
    def nbytes(self) -> int:
        return self.planes * self.rows * self.row_bytes

    def key(self) -> tuple[object, ...]:
        return (self.algo, self.shape, self.item, self.tile_rows, self.tile_cols)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Tiling) and self.key() == other.key()

    def __hash__(self) -> int:
        return hash(self.key())

    def __repr__(self) -> str:
        return f"Tiling({self.algo}, {self.shape}, item={self.item}, tile={self.tile_rows}×{self.tile_cols})"

    def aligned(self, box: Box) -> Box:
        """``box`` widened to whole tiles (the whole shard when one digest covers it)."""
        if self.tile_rows == 0:
            return self.box
        if not self.shape:
            return box
        (c0, c1) = box[-1]
        cols = (c0 // self.tile_cols * self.tile_cols, min(self.cols, -(-c1 // self.tile_cols) * self.tile_cols))
        if len(self.shape) == 1:
            return (cols,)
        (r0, r1), br = box[-2], self.tile_rows
        rows = (r0 // br * br, min(self.rows, -(-r1 // br) * br))
        return (*box[:-2], rows, cols)


def choose_tiling(shape: Sequence[int], item: int, columns: bool = True) -> tuple[int, int]:
    """The publisher's (tile rows, tile columns) for a shard.

    Blocks of 64 rows (fewer when 64 rows exceed 4 MiB). Columns of a 2-D+ shard cut in 8 equal
    ranges when the width divides, each range is whole 8-byte words and at least 128 bytes;
    otherwise one range per row. A range wider than 4 MiB (a 1-D shard, a huge row) is cut into
    ranges of 4 MiB. ``columns=False``: no column ranges (one contiguous pass over the shard, for
    receivers that never read a column slice; ``rf.Publisher(column_digests=False)``).
    """
    shape = tuple(shape)
    rows = shape[-2] if len(shape) >= 2 else 1
    cols = shape[-1] if shape else 1
    row = cols * item
    br = max(1, min(rows, TILE_ROWS, MAX_TILE_BYTES // max(row, 1)))
    part = cols // COLUMN_PARTS
    wide = (
        columns and len(shape) >= 2 and cols % COLUMN_PARTS == 0 and (part * item) % 8 == 0
        and part * item >= MIN_COLUMN_BYTES
    )  # fmt: skip
    bc = part if wide else cols
    if bc * item > MAX_TILE_BYTES:
        bc = MAX_TILE_BYTES // item
    return br, max(bc, 1)


# -- units: what of a landed box can be checked against which digest -----------------------------


class Unit(NamedTuple):
    """One digest unit a landed box touches (see ``units_of``)."""

    slot: int  # which of the shard's digests
    covered: int  # bytes of the unit the box holds
    total: int  # bytes of the whole unit
    lo: int  # where those bytes start in the landed box (when contiguous there)
    start: int  # their offset in the unit's byte string (xxh3 streams in order)
    mode: int  # 1: contiguous in the box (mix64: word-aligned); 2: whole but strided (xxh3 gathers); 0: unchecked


def frame(t: Tiling, box: Box) -> tuple[list[int], int, int, int, int]:
    """(flat plane indices, r0, r1, c0, c1) of a box of the shard."""
    if not t.shape:
        return [0], 0, 1, 0, 1
    if len(t.shape) == 1:
        return [0], 0, 1, box[0][0], box[0][1]
    planes = [0]
    for (a, b), n in zip(box[:-2], t.shape[:-2], strict=True):
        planes = [p * n + i for p in planes for i in range(a, b)]
    return planes, box[-2][0], box[-2][1], box[-1][0], box[-1][1]


def _word_aligned(t: Tiling, c0: int, c1: int) -> bool:
    return (c0 * t.item) % 8 == 0 and (c1 == t.cols or (c1 * t.item) % 8 == 0)


def units_of(t: Tiling, box: Box) -> list[Unit]:
    """The units ``box`` touches, for the box landed contiguously (row-major), in (plane, block,
    column range) order — the order ``mix64_box`` and ``xxh3_gathered`` return theirs in.

    xxh3 on whole rows with row digests (or one column range): the row blocks; otherwise the tiles.
    """
    planes, r0, r1, c0, c1 = frame(t, box)
    if t.tile_rows == 0:
        return [_whole_shard_unit(t, box, len(planes) * (r1 - r0) * (c1 - c0) * t.item, c0, c1)]
    item, br, bc = t.item, t.tile_rows, t.tile_cols
    lb, mb, row = (c1 - c0) * item, r1 - r0, t.row_bytes
    blocks = []
    for i in range(r0 // br, -(-r1 // br)):
        top = min((i + 1) * br, t.rows)
        blocks.append((i, max(r0, i * br), min(r1, top), top - i * br))
    out: list[Unit] = []
    if t.algo == "xxh3" and c0 == 0 and c1 == t.cols and (t.row_digests or t.nc == 1):  # whole-row units
        extra = t.tiles if t.row_digests else 0
        for k, p in enumerate(planes):
            for i, ra, rb, tr in blocks:
                lo = (k * mb + ra - r0) * lb
                out.append(Unit(extra + p * t.nr + i, (rb - ra) * row, tr * row, lo, (ra - i * br) * row, 1))
        return out
    cols = []
    for j in range(c0 // bc, -(-c1 // bc)):
        right = min((j + 1) * bc, t.cols)
        cols.append((j, max(c0, j * bc), min(c1, right), right - j * bc))
    aligned = _word_aligned(t, c0, c1)
    for k, p in enumerate(planes):
        for i, ra, rb, tr in blocks:
            for j, ca, cb, tc in cols:
                covered, total = (rb - ra) * (cb - ca) * item, tr * tc * item
                lo = (k * mb + ra - r0) * lb + (ca - c0) * item
                start = ((ra - i * br) * tc + ca - j * bc) * item
                if t.algo == "mix64":
                    mode = 1 if aligned else 0
                else:
                    single = rb - ra == 1
                    in_box = single or (ca == c0 and cb == c1)
                    in_tile = single or cb - ca == tc
                    mode = 1 if in_box and in_tile else (2 if covered == total else 0)
                out.append(Unit((p * t.nr + i) * t.nc + j, covered, total, lo, start, mode))
    return out


class Units(NamedTuple):
    """``units_of`` as arrays (one entry per unit, same fields as ``Unit``)."""

    slot: np.ndarray
    covered: np.ndarray
    total: np.ndarray
    lo: np.ndarray
    start: np.ndarray
    mode: np.ndarray


def unit_count(t: Tiling, box: Box) -> int:
    """How many units ``units_of(t, box)`` lists (cheap: no enumeration)."""
    planes, r0, r1, c0, c1 = frame(t, box)
    if t.tile_rows == 0:
        return 1
    rows = -(-r1 // t.tile_rows) - r0 // t.tile_rows
    if t.algo == "xxh3" and c0 == 0 and c1 == t.cols and (t.row_digests or t.nc == 1):
        return len(planes) * rows
    return len(planes) * rows * (-(-c1 // t.tile_cols) - c0 // t.tile_cols)


def units_array(t: Tiling, box: Box) -> Units:
    """``units_of`` computed with numpy (for boxes of many units; the same values, in the same order)."""
    planes_list, r0, r1, c0, c1 = frame(t, box)
    if t.tile_rows == 0:
        u = _whole_shard_unit(t, box, len(planes_list) * (r1 - r0) * (c1 - c0) * t.item, c0, c1)
        return Units(*(np.array([x], dtype=np.int64) for x in u))
    planes = np.array(planes_list, dtype=np.int64)
    item, br, bc = t.item, t.tile_rows, t.tile_cols
    lb, mb, row = (c1 - c0) * item, r1 - r0, t.row_bytes
    i = np.arange(r0 // br, -(-r1 // br), dtype=np.int64)
    top = np.minimum((i + 1) * br, t.rows)
    ra, rb, tr = np.maximum(r0, i * br), np.minimum(r1, top), top - i * br
    k = np.arange(len(planes), dtype=np.int64)
    if t.algo == "xxh3" and c0 == 0 and c1 == t.cols and (t.row_digests or t.nc == 1):  # whole-row units
        extra = t.tiles if t.row_digests else 0
        if len(planes) == 1:  # the common case, without the grid
            return Units(extra + planes[0] * t.nr + i, (rb - ra) * row, tr * row, (ra - r0) * lb, (ra - i * br) * row,
                         np.ones(len(i), dtype=np.int64))  # fmt: skip
        kk, ii = np.repeat(k, len(i)), np.tile(np.arange(len(i)), len(k))
        covered = (rb - ra)[ii] * row
        return Units(extra + planes[kk] * t.nr + i[ii], covered, tr[ii] * row, (kk * mb + ra[ii] - r0) * lb,
                     (ra[ii] - i[ii] * br) * row, np.ones(len(kk), dtype=np.int64))  # fmt: skip
    j = np.arange(c0 // bc, -(-c1 // bc), dtype=np.int64)
    right = np.minimum((j + 1) * bc, t.cols)
    ca, cb, tc = np.maximum(c0, j * bc), np.minimum(c1, right), right - j * bc
    ni, nj = len(i), len(j)
    kk, ii, jj = (
        np.repeat(k, ni * nj),
        np.tile(np.repeat(np.arange(ni), nj), len(k)),
        np.tile(np.arange(nj), len(k) * ni),
    )
    nrows, ncols = (rb - ra)[ii], (cb - ca)[jj]
    covered, total = nrows * ncols * item, tr[ii] * tc[jj] * item
    lo = (kk * mb + ra[ii] - r0) * lb + (ca[jj] - c0) * item
    start = ((ra[ii] - i[ii] * br) * tc[jj] + ca[jj] - j[jj] * bc) * item
    if t.algo == "mix64":
        mode = np.full(len(lo), 1 if _word_aligned(t, c0, c1) else 0, dtype=np.int64)
    else:
        single = nrows == 1
        in_box = single | ((ca[jj] == c0) & (cb[jj] == c1))
        in_tile = single | (ncols == tc[jj])
        mode = np.where(in_box & in_tile, 1, np.where(covered == total, 2, 0)).astype(np.int64)
    return Units((planes[kk] * t.nr + i[ii]) * t.nc + j[jj], covered, total, lo, start, mode)


def _whole_shard_unit(t: Tiling, box: Box, covered: int, c0: int, c1: int) -> Unit:
    """One digest over the shard: the box is part of it (checkable if contiguous there, for xxh3)."""
    if t.algo == "mix64":
        return Unit(0, covered, t.nbytes, 0, 0, 1 if _word_aligned(t, c0, c1) else 0)
    span = _span(box, t.shape)
    return Unit(0, covered, t.nbytes, 0, (span or 0) * t.item, 0 if span is None else 1)


def _span(box: Box, shape: tuple[int, ...]) -> int | None:
    """The first element of ``box`` when it is one contiguous run of a row-major ``shape``."""
    d = len(shape)
    while d > 0 and box[d - 1] == (0, shape[d - 1]):
        d -= 1
    if any(e - s != 1 for s, e in box[: max(d - 1, 0)]):
        return None
    first, stride = 0, 1
    for (s, _), n in zip(reversed(box), reversed(shape), strict=True):
        first += s * stride
        stride *= n
    return first
