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

**Algorithms.**

- ``xxh3``: xxh3_64 of a unit's bytes in row-major order (a tile's row segments one after another).
  Fastest on a CPU (≈20 GB/s on one core here). A tile of several rows and column ranges is strided
  in memory: it is gathered through a small scratch buffer (the publisher, and a receiver for the
  column slices it staged: ≈7 GB/s); a reader of whole rows hashes the row-block digests instead.
  Bytes on a device are copied to the host through a bounded bounce buffer — the slow combination.
- ``mix64``: defined with torch integer operations, so it gives the same value on every device.
  Row ``r`` (counted over all planes) is padded with zero bytes to ``W`` 8-byte little-endian words;
  word ``j`` of it sits at position ``pos = r·W + j``. Its contribution is
  ``fmix(word XOR pos·K)`` (``fmix``: splitmix64's finaliser, a bijection), and a unit's digest is
  the wrap-around sum of its words' contributions. For a fixed position a contribution is a
  bijection of the word, so any single changed word always changes the digest; random corruption
  escapes with probability ≈ 2^-64. It is a checksum against faults, **not** a MAC: anyone who can
  write the bytes can forge it. Being a sum, a tile's digest is the sum over any split of its words
  (so pieces may arrive in any order) and a block's digest is the sum of its tiles'.

Everything runs as batched torch (mix64) or one C call per unit (xxh3) on the tensor's own device;
only the digests come back to the host.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch
import xxhash

__all__ = [
    "ALGORITHMS",
    "Tiling",
    "Unit",
    "Units",
    "choose_tiling",
    "hash_ranges",
    "mix64_box",
    "mix64_box_on_device",
    "shard_digests",
    "to_host",
    "unit_count",
    "units_array",
    "units_of",
    "xxh3_gathered",
]

ALGORITHMS = ("xxh3", "mix64")
TILE_ROWS = 64  # rows per block, fewer when they exceed MAX_TILE_BYTES
MAX_TILE_BYTES = 4 << 20
COLUMN_PARTS = 8  # TP degrees up to 8 slice columns at multiples of C/8
MIN_COLUMN_BYTES = 128  # narrower column ranges are not worth their digests
BOUNCE_BYTES = 16 << 20  # host bounce buffer for xxh3 of device bytes
GATHER_BYTES = 1 << 20  # xxh3's tile gather permutes this much at a time (in cache)
_CPU_CHUNK_WORDS = 1 << 15  # mix64 works through this many words at a time: in cache on a CPU,
_DEVICE_CHUNK_WORDS = 1 << 24  # big launches on a device

Box = tuple[tuple[int, int], ...]


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


_K = _signed(0x9E3779B97F4A7C15)  # position key (odd)
_M1 = _signed(0xBF58476D1CE4E5B9)  # splitmix64 finaliser multipliers (odd)
_M2 = _signed(0x94D049BB133111EB)


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
            return tuple((0, d) for d in self.shape)
        if not self.shape:
            return box
        (c0, c1) = box[-1]
        cols = (c0 // self.tile_cols * self.tile_cols, min(self.cols, -(-c1 // self.tile_cols) * self.tile_cols))
        if len(self.shape) == 1:
            return (cols,)
        (r0, r1), br = box[-2], self.tile_rows
        rows = (r0 // br * br, min(self.rows, -(-r1 // br) * br))
        return (*box[:-2], rows, cols)


def choose_tiling(shape: Sequence[int], item: int) -> tuple[int, int]:
    """The publisher's (tile rows, tile columns) for a shard.

    Blocks of 64 rows (fewer when 64 rows exceed 4 MiB). Columns of a 2-D+ shard cut in 8 equal
    ranges when the width divides, each range is whole 8-byte words and at least 128 bytes;
    otherwise one range per row. A range wider than 4 MiB (a 1-D shard, a huge row) is cut into
    ranges of 4 MiB.
    """
    shape = tuple(shape)
    rows = shape[-2] if len(shape) >= 2 else 1
    cols = shape[-1] if shape else 1
    row = cols * item
    br = max(1, min(rows, TILE_ROWS, MAX_TILE_BYTES // max(row, 1)))
    part = cols // COLUMN_PARTS
    wide = len(shape) >= 2 and cols % COLUMN_PARTS == 0 and (part * item) % 8 == 0 and part * item >= MIN_COLUMN_BYTES
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


# -- xxh3 ---------------------------------------------------------------------------------------


def hash_ranges(buf: torch.Tensor, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """xxh3_64 of ``buf[lo[i]:hi[i]]`` for each i (``buf``: 1-D uint8 on any device)."""
    if buf.device.type == "cpu":
        mv = buf.numpy().data
        h = xxhash.xxh3_64_intdigest
        return np.fromiter((h(mv[a:b]) for a, b in zip(lo.tolist(), hi.tolist(), strict=True)), np.uint64, len(lo))
    return _hash_ranges_bounced(buf, lo, hi, np.empty(len(lo), dtype=np.uint64))


def _hash_ranges_bounced(
    buf: torch.Tensor, lo: np.ndarray, hi: np.ndarray, out: np.ndarray, bounce_bytes: int = BOUNCE_BYTES
) -> np.ndarray:
    """Device bytes: copied to the host through one bounded bounce buffer, ranges grouped per copy."""
    bounce = torch.empty(bounce_bytes, dtype=torch.uint8)
    mv = bounce.numpy().data
    order = np.argsort(lo, kind="stable")
    n = 0
    while n < len(order):
        first = int(lo[order[n]])
        if int(hi[order[n]]) - first > bounce_bytes:  # one big unit: stream it
            h = xxhash.xxh3_64()
            for a in range(first, int(hi[order[n]]), bounce_bytes):
                b = min(a + bounce_bytes, int(hi[order[n]]))
                bounce[: b - a].copy_(buf[a:b])
                h.update(mv[: b - a])
            out[order[n]] = h.intdigest()
            n += 1
            continue
        m = n
        end = first
        while m < len(order) and int(hi[order[m]]) - first <= bounce_bytes:
            end = max(end, int(hi[order[m]]))
            m += 1
        bounce[: end - first].copy_(buf[first:end])
        for u in order[n:m].tolist():
            out[u] = xxhash.xxh3_64_intdigest(mv[int(lo[u]) - first : int(hi[u]) - first])
        n = m
    return out


def xxh3_gathered(data: torch.Tensor, t: Tiling, box: Box, blocks: list[int] | None = None) -> np.ndarray:
    """xxh3 of every tile touched by ``box`` (whole tiles only), gathered through a bounded scratch.

    ``data`` holds the box row-major (any device: the gathered tiles come to the host). Results are
    in ``units_of`` tile order; a tile the box does not hold whole gets 0 (its unit is not checked).
    ``blocks``: also append the xxh3 of each row block (the box must be whole rows).

    Runs of whole row blocks of whole, equal column ranges are permuted into the scratch by one copy
    per ``GATHER_BYTES`` (a copy per block cost more than its hashing: 3× slower at 2 KiB rows).
    """
    planes, r0, r1, c0, c1 = frame(t, box)
    br, bc, item = t.tile_rows, t.tile_cols, t.item
    rows = data.reshape(-1).view(torch.uint8).view(len(planes), r1 - r0, (c1 - c0) * item)
    j0, j1 = c0 // bc, -(-c1 // bc)
    regular = c0 % bc == 0 and (c1 - c0) % bc == 0  # whole column ranges of equal width
    w, nj = bc * item, j1 - j0
    block_bytes = br * (c1 - c0) * item
    group = max(1, GATHER_BYTES // block_bytes)
    scratch = torch.empty(min(group * br, r1 - r0) * (c1 - c0) * item, dtype=torch.uint8)
    mv = scratch.numpy().data
    h = xxhash.xxh3_64_intdigest
    out: list[int] = []
    for k in range(len(planes)):
        i, i1 = r0 // br, -(-r1 // br)
        while i < i1:
            a, b = max(r0, i * br), min(r1, (i + 1) * br, t.rows)
            if regular and a == i * br and b - a == br:  # a run of whole, full blocks: permute them at once
                g = min(group, (min(r1, t.rows) - a) // br)
                src = rows[k, a - r0 : a - r0 + g * br]
                if blocks is not None:
                    whole = src if src.device.type == "cpu" else src.cpu()
                    wv, bb = whole.reshape(-1).numpy().data, block_bytes
                    blocks += [h(wv[q * bb : (q + 1) * bb]) for q in range(g)]
                n = br * w
                scratch[: g * block_bytes].view(g, nj, br, w).copy_(src.view(g, br, nj, w).transpose(1, 2))
                out += [h(mv[q * n : (q + 1) * n]) for q in range(g * nj)]
                i += g
                continue
            whole_rows = a == i * br and b == min((i + 1) * br, t.rows)
            block = rows[k, a - r0 : b - r0]
            if blocks is not None:
                blocks.append(h((block if block.device.type == "cpu" else block.cpu()).numpy().data))
            if regular and whole_rows:  # the last, shorter block
                n = (b - a) * w
                scratch[: n * nj].view(nj, b - a, w).copy_(block.reshape(b - a, nj, w).transpose(0, 1))
                out += [h(mv[q * n : (q + 1) * n]) for q in range(nj)]
            else:
                for j in range(j0, j1):
                    x, y = max(c0, j * bc), min(c1, (j + 1) * bc, t.cols)
                    if not (whole_rows and x == j * bc and y == min((j + 1) * bc, t.cols)):
                        out.append(0)
                        continue
                    tile = block[:, (x - c0) * item : (y - c0) * item].contiguous().cpu()
                    out.append(h(tile.numpy().data))
            i += 1
    return np.array(out, dtype=np.uint64)


# -- mix64 --------------------------------------------------------------------------------------


def _fmix(x: torch.Tensor, tmp: torch.Tensor) -> None:
    """splitmix64's finaliser in place on int64 (logical shifts: torch shifts int64 arithmetically)."""
    for shift, mult in ((30, _M1), (27, _M2), (31, None)):
        torch.bitwise_right_shift(x, shift, out=tmp)
        tmp.bitwise_and_((1 << (64 - shift)) - 1)
        x.bitwise_xor_(tmp)
        if mult is not None:
            x.mul_(mult)


def _words(rows: torch.Tensor) -> torch.Tensor:
    """(R, L) uint8 → (R, ceil(L/8)) int64 words, zero-padded (a copy only when not already words)."""
    r, length = rows.shape
    if length % 8 == 0 and rows.data_ptr() % 8 == 0 and rows.stride(1) == 1 and rows.stride(0) == length:
        return rows.view(torch.int64)
    padded = torch.zeros(r, -(-length // 8) * 8, dtype=torch.uint8, device=rows.device)
    padded[:, :length] = rows
    return padded.view(torch.int64)


def mix64_box(data: torch.Tensor, t: Tiling, box: Box) -> np.ndarray:
    """mix64 sums (see ``mix64_box_on_device``), brought to the host as uint64."""
    return to_host(mix64_box_on_device(data, t, box))


def to_host(sums: torch.Tensor) -> np.ndarray:
    """int64 sums on any device → uint64 on the host (one copy for however many)."""
    return sums.cpu().numpy().view(np.uint64).copy()


def mix64_box_on_device(data: torch.Tensor, t: Tiling, box: Box) -> torch.Tensor:
    """mix64 sums (int64) of ``box``'s part of every tile it touches, in ``units_of`` order, left on
    ``data``'s device.

    ``data`` holds the box row-major (contiguous, any dtype, any device); the box's column edges
    must be whole words (``units_of`` marks other boxes unchecked). ``tile_rows == 0``: one sum.
    """
    planes, r0, r1, c0, c1 = frame(t, box)
    dev = data.device
    item, mb = t.item, r1 - r0
    br, bc = (t.tile_rows, t.tile_cols) if t.tile_rows else (max(t.rows, 1), max(t.cols, 1))
    w_row = -(-t.row_bytes // 8)  # words per shard row
    j0w = c0 * item // 8
    rows = data.reshape(-1).view(torch.uint8).view(len(planes) * mb, (c1 - c0) * item)
    nwords = -(-rows.shape[1] // 8)
    # column word -> tile column (relative to the box's first tile column)
    col_of_word = (torch.arange(j0w, j0w + nwords, device=dev, dtype=torch.int64) * 8) // item
    jcol = col_of_word // bc - c0 // bc
    ncb = -(-c1 // bc) - c0 // bc
    nrb = -(-r1 // br) - r0 // br
    # global row of every box row, and its tile row (relative), over all planes
    m = torch.arange(r0, r1, device=dev, dtype=torch.int64)
    p = torch.tensor(planes, device=dev, dtype=torch.int64)
    grow = (p[:, None] * t.rows + m[None, :]).reshape(-1)
    irow = ((torch.arange(len(planes), device=dev)[:, None] * nrb) + (m[None, :] // br - r0 // br)).reshape(-1)
    ck = torch.arange(j0w, j0w + nwords, device=dev, dtype=torch.int64).mul_(_K)
    rk_mult = _signed((w_row * (_K % (1 << 64))) % (1 << 64))
    out = torch.zeros(len(planes) * nrb, ncb, dtype=torch.int64, device=dev)
    bcw = bc * item // 8 if ncb > 1 else nwords  # words per column range (whole words when there are several)
    regular = ncb == 1 or (c0 % bc == 0 and nwords == ncb * bcw)
    step = max(1, (_CPU_CHUNK_WORDS if dev.type == "cpu" else _DEVICE_CHUNK_WORDS) // max(nwords, 1))
    for a in range(0, rows.shape[0], step):
        x = torch.add(grow[a : a + step, None] * rk_mult, ck[None, :])
        x.bitwise_xor_(_words(rows[a : a + step]))
        _fmix(x, torch.empty_like(x))
        if regular:
            per_tile = x.view(x.shape[0], ncb, bcw).sum(dim=2)
        else:
            per_tile = torch.zeros(x.shape[0], ncb, dtype=torch.int64, device=dev).index_add_(1, jcol, x)
        out.index_add_(0, irow[a : a + step], per_tile)
    sums = out.reshape(-1)
    return sums.sum().reshape(1) if t.tile_rows == 0 else sums


# -- the publisher's pass -----------------------------------------------------------------------


def shard_digests(tensor: torch.Tensor, t: Tiling) -> np.ndarray:
    """Every digest of a contiguous shard, on its own device (only the digests come back)."""
    data = tensor.detach().reshape(-1).view(torch.uint8)
    full = tuple((0, d) for d in t.shape)
    if t.algo == "mix64":
        return mix64_box(tensor.detach(), t, full)
    out = np.empty(t.count, dtype=np.uint64)
    if t.row_digests:  # the tiles are strided: gather them, each row block hashed first (one pass)
        blocks: list[int] = []
        out[: t.tiles] = xxh3_gathered(tensor.detach(), t, full, blocks)
        out[t.tiles :] = blocks
        return out
    units = units_of(t, full)
    lo = np.array([u.lo for u in units], dtype=np.int64)
    out[[u.slot for u in units]] = hash_ranges(data, lo, lo + np.array([u.covered for u in units], dtype=np.int64))
    return out
