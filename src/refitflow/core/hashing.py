"""The two digest algorithms over ``core/digests.py``'s tile geometry, computed where the bytes are.

**Algorithms.**

- ``xxh3``: xxh3_64 of a unit's bytes in row-major order (a tile's row segments one after another).
  Fastest on a CPU (≈25 GB/s over contiguous bytes on one core here). A tile of several rows and
  column ranges is strided in memory: it is gathered through a small scratch buffer, runs of row
  blocks at a time (the publisher, row blocks and tiles together: 7–9 GB/s; a receiver for the column
  slices it staged); a reader of whole rows hashes the row-block digests instead.
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

import functools
from typing import Any

import numpy as np
import torch
import xxhash

from refitflow.core.digests import Box, Tiling, frame, units_of

__all__ = ["hash_ranges", "mix64_box", "mix64_box_on_device", "shard_digests", "to_host", "xxh3_gathered"]

BOUNCE_BYTES = 16 << 20  # host bounce buffer for xxh3 of device bytes
GATHER_BYTES = 1 << 20  # xxh3's tile gather permutes this much at a time (in cache)
_CPU_CHUNK_WORDS = 1 << 15  # mix64 works through this many words at a time: in cache on a CPU,
_DEVICE_CHUNK_WORDS = 1 << 24  # big launches on a device


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


_K = _signed(0x9E3779B97F4A7C15)  # position key (odd)
_M1 = _signed(0xBF58476D1CE4E5B9)  # splitmix64 finaliser multipliers (odd)
_M2 = _signed(0x94D049BB133111EB)


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
    if t.algo == "mix64":
        return mix64_box(tensor.detach(), t, t.box)
    if t.row_digests:  # the tiles are strided: gather them, each row block hashed first (one pass)
        out = np.empty(t.count, dtype=np.uint64)
        blocks: list[int] = []
        out[: t.tiles] = xxh3_gathered(tensor.detach(), t, t.box, blocks)
        out[t.tiles :] = blocks
        return out
    data = tensor.detach()
    data = (data if data.dim() == 1 else data.reshape(-1)).view(torch.uint8)
    ranges = _contiguous_units(t)
    if data.device.type != "cpu":
        lo = np.array([a for a, _ in ranges], dtype=np.int64)
        return hash_ranges(data, lo, np.array([b for _, b in ranges], dtype=np.int64))
    h = xxhash.xxh3_64_intdigest
    whole: Any = data.numpy()
    if len(ranges) == 1:
        return np.array([h(whole)], dtype=np.uint64)
    return np.fromiter((h(whole[a:b]) for a, b in ranges), np.uint64, len(ranges))


@functools.lru_cache(maxsize=1 << 12)
def _contiguous_units(t: Tiling) -> tuple[tuple[int, int], ...]:
    """The byte ranges of a shard's digest units, in digest order, when every unit is contiguous (xxh3
    without row digests: whole row blocks, or column ranges of one-row blocks). Per geometry: a model's
    shards repeat a few (a publisher of 10,000 tensors spent ≈ 14 µs each recomputing them)."""
    units = units_of(t, t.box)
    assert [u.slot for u in units] == list(range(t.count)), "contiguous units are in digest order"
    return tuple((u.lo, u.lo + u.covered) for u in units)
