"""The digest scheme: mix64 against a plain-Python reading of its definition, same bytes → same digests on
every device, sums over tiles, the units a landed box holds, and the publisher's tile geometry."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from refitflow.core import hashing
from refitflow.core.digests import Tiling, choose_tiling, frame, unit_count, units_array, units_of
from refitflow.core.dtypes import _BY_NAME
from refitflow.core.hashing import _hash_ranges_bounced, hash_ranges, mix64_box, shard_digests, xxh3_gathered

M64 = (1 << 64) - 1
# every device this machine has: the same code runs on each (CPU here; CUDA where one is visible)
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _fmix(z: int) -> int:
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & M64
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB & M64
    return z ^ (z >> 31)


def _reference_mix64(data: bytes, shape: tuple[int, ...], item: int) -> int:
    """The module docstring's definition, word by word in plain Python."""
    cols = shape[-1] if shape else 1
    rows = math.prod(shape[:-1]) if shape else 1
    row = cols * item
    words = -(-row // 8)
    total = 0
    for r in range(rows):
        padded = data[r * row : (r + 1) * row] + bytes(words * 8 - row)
        for j in range(words):
            w = int.from_bytes(padded[8 * j : 8 * j + 8], "little")
            total = (total + _fmix(w ^ ((r * words + j) * 0x9E3779B97F4A7C15 & M64))) & M64
    return total


def _random(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (math.prod(shape) * dtype.itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


@pytest.mark.parametrize("dtype", sorted(_BY_NAME.values(), key=str))
@pytest.mark.parametrize("shape", [(), (5,), (7, 3), (2, 3, 5), (4, 16)])
def test_mix64_is_its_definition_for_every_dtype_and_odd_row(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    x = _random(shape, dtype)
    whole = Tiling("mix64", shape, dtype.itemsize, 0, 0)
    want = _reference_mix64(x.reshape(-1).view(torch.uint8).numpy().tobytes(), shape, dtype.itemsize)
    assert int(shard_digests(x, whole)[0]) == want
    tiles = Tiling("mix64", shape, dtype.itemsize, *choose_tiling(shape, dtype.itemsize))
    assert int(shard_digests(x, tiles).astype(object).sum()) & M64 == want  # the tiles sum to the whole


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("algo", ["xxh3", "mix64"])
@pytest.mark.parametrize("dtype", sorted(_BY_NAME.values(), key=str))
def test_the_same_bytes_give_the_same_digests_on_every_device(device: str, algo: str, dtype: torch.dtype) -> None:
    shape = (130, 2048 // dtype.itemsize)  # wide enough for 8 column ranges
    x = _random(shape, dtype, seed=3)
    t = Tiling(algo, shape, dtype.itemsize, *choose_tiling(shape, dtype.itemsize))
    assert t.nc == 8 and t.nr == 3
    on_cpu = shard_digests(x, t)
    assert np.array_equal(shard_digests(x.to(device), t), on_cpu)
    # the same bytes under another dtype of the same width: the same digests
    twin = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[dtype.itemsize]
    assert np.array_equal(shard_digests(x.view(twin).to(device), t), on_cpu)


def test_any_changed_byte_changes_the_mix64_digest() -> None:
    x = _random((3, 10), torch.bfloat16, seed=1)
    t = Tiling("mix64", (3, 10), 2, 0, 0)
    base = int(shard_digests(x, t)[0])
    raw = x.view(torch.uint8)
    for i in range(raw.numel()):
        flipped = raw.clone().reshape(-1)
        flipped[i] ^= 1 << (i % 8)
        assert int(shard_digests(flipped.view(torch.bfloat16).reshape(3, 10), t)[0]) != base, i


def test_a_tile_is_the_sum_of_any_split_of_it() -> None:
    x = _random((130, 1024), torch.bfloat16, seed=2)
    t = Tiling("mix64", x.shape, 2, 64, 128)
    digests = shard_digests(x, t)
    top = mix64_box(x[64:100, 128:384].contiguous(), t, ((64, 100), (128, 384)))
    bottom = mix64_box(x[100:128, 128:384].contiguous(), t, ((100, 128), (128, 384)))
    assert np.array_equal(top + bottom, digests[[t.nc + 1, t.nc + 2]])


def test_xxh3_digests_are_of_contiguous_tiles_then_of_row_blocks() -> None:
    x = _random((130, 1024), torch.bfloat16, seed=4)
    t = Tiling("xxh3", x.shape, 2, *choose_tiling(x.shape, 2))
    d = shard_digests(x, t)
    assert t.row_digests and t.count == 3 * 8 + 3
    tile = x[64:128, 128:256].contiguous().view(torch.uint8).numpy().tobytes()
    assert int(d[t.nc + 1]) == xxhash.xxh3_64_intdigest(tile)
    rows = x[128:130].contiguous().view(torch.uint8).numpy().tobytes()
    assert int(d[t.tiles + 2]) == xxhash.xxh3_64_intdigest(rows)


@settings(max_examples=60, deadline=None)
@given(
    planes=st.integers(1, 3),
    rows=st.integers(1, 40),
    parts=st.integers(1, 4),
    tile_rows=st.integers(1, 9),
    cut=st.tuples(st.integers(0, 40), st.integers(0, 40), st.integers(0, 3), st.integers(1, 4)),
    gather=st.sampled_from([1, 96, 1 << 20]),
)
def test_gathered_tiles_hash_as_each_tile_copied_out_alone(planes, rows, parts, tile_rows, cut, gather) -> None:
    """Runs of whole row blocks are permuted into the scratch in groups (``GATHER_BYTES``): every
    grouping, a shorter last block, partial blocks and column ranges give each tile's own xxh3."""
    tile_rows = min(tile_rows, rows)
    shape, bc = (planes, rows, parts * 4), 4
    x = _random(shape, torch.int16, seed=rows * 7 + parts)
    t = Tiling("xxh3", shape, 2, tile_rows, bc)
    r0, r1 = sorted((cut[0] % rows, cut[1] % rows))
    j0, j1 = min(cut[2], parts - 1), min(cut[2] + cut[3], parts)
    box = ((0, planes), (r0, r1 + 1), (j0 * bc, j1 * bc))
    want = []
    for p in range(planes):
        for i in range(r0 // tile_rows, -(-(r1 + 1) // tile_rows)):
            a, b = i * tile_rows, min((i + 1) * tile_rows, rows)
            for j in range(j0, j1):
                whole = a >= r0 and b <= r1 + 1
                tile = x[p, a:b, j * bc : (j + 1) * bc].contiguous().view(torch.uint8).numpy().tobytes()
                want.append(xxhash.xxh3_64_intdigest(tile) if whole else 0)
    data = x[:, r0 : r1 + 1, j0 * bc : j1 * bc].contiguous()
    old = hashing.GATHER_BYTES
    hashing.GATHER_BYTES = gather
    whole_rows = (j0, j1) == (0, parts) and r0 % tile_rows == 0 and ((r1 + 1) % tile_rows == 0 or r1 + 1 == rows)
    blocks: list[int] | None = [] if whole_rows else None
    try:
        got = xxh3_gathered(data, t, box, blocks)
    finally:
        hashing.GATHER_BYTES = old
    assert got.tolist() == want
    if blocks is not None:  # a reader of whole rows: one digest per row block, its bytes as they lie
        starts = range(r0, r1 + 1, tile_rows)
        assert blocks == [xxhash.xxh3_64_intdigest(x[p, a : min(a + tile_rows, rows)].contiguous().numpy().tobytes())
                          for p in range(planes) for a in starts]  # fmt: skip


def test_device_bytes_hash_through_a_bounded_bounce_buffer() -> None:
    buf = _random((5000,), torch.uint8, seed=5)
    lo = np.array([0, 10, 100, 3000, 2999], dtype=np.int64)
    hi = np.array([10, 4000, 101, 5000, 3001], dtype=np.int64)
    want = hash_ranges(buf, lo, hi)  # the CPU path: memoryviews, no copy
    got = _hash_ranges_bounced(buf, lo, hi, np.empty(5, dtype=np.uint64), bounce_bytes=512)
    assert np.array_equal(got, want)


def test_wide_rows_are_cut_in_eight_word_aligned_column_ranges() -> None:
    assert choose_tiling((14336, 4096), 2) == (64, 512)  # gate_proj: 8 ranges of 1 KiB
    assert choose_tiling((4096, 14336), 2) == (64, 1792)  # down_proj
    assert choose_tiling((64, 64), 2) == (64, 64)  # too narrow: whole rows
    assert choose_tiling((1 << 24,), 2) == (1, 1 << 21)  # 1-D: 4 MiB ranges
    assert choose_tiling((8, 1 << 22), 4) == (1, 1 << 19)  # 2 MiB ranges of huge rows
    for tp in (1, 2, 4, 8):  # every TP slice of a row-parallel weight is whole tiles
        t = Tiling("xxh3", (4096, 14336), 2, 64, 1792)
        width = 14336 // tp
        assert all(t.aligned(((0, 4096), (r * width, (r + 1) * width))) == ((0, 4096), (r * width, (r + 1) * width))
                   for r in range(tp))  # fmt: skip


@st.composite
def _case(draw: st.DrawFn) -> tuple[Tiling, tuple[tuple[int, int], ...]]:
    ndim = draw(st.integers(0, 3))
    shape = tuple(draw(st.lists(st.integers(1, 40), min_size=ndim, max_size=ndim)))
    item = draw(st.sampled_from([1, 2, 4, 8]))
    algo = draw(st.sampled_from(["xxh3", "mix64"]))
    rows = shape[-2] if ndim >= 2 else 1
    cols = shape[-1] if ndim else 1
    tile_rows = draw(st.integers(0, rows))
    w = max(1, 8 // item)
    tile_cols = draw(st.sampled_from(sorted({cols, *range(w, cols, w)}))) if tile_rows else 0
    box = tuple((a, draw(st.integers(a + 1, n))) for n in shape for a in [draw(st.integers(0, n - 1))])
    return Tiling(algo, shape, item, tile_rows, tile_cols), box


@settings(max_examples=300, deadline=None)
@given(_case())
def test_units_listed_with_numpy_are_the_units_listed_in_python(case) -> None:
    t, box = case
    small = units_of(t, box)
    big = units_array(t, box)
    assert len(small) == unit_count(t, box) == len(big.slot)
    for field in ("slot", "covered", "total", "lo", "start", "mode"):
        assert [getattr(u, field) for u in small] == getattr(big, field).tolist(), field
    planes, r0, r1, c0, c1 = frame(t, box)
    if t.tile_rows and all(u.mode for u in small):  # every byte of the box belongs to exactly one unit
        assert sum(u.covered for u in small) == len(planes) * (r1 - r0) * (c1 - c0) * t.item


@settings(max_examples=60, deadline=None)
@given(
    shape=st.lists(st.integers(1, 9), min_size=0, max_size=3),
    tile_rows=st.integers(1, 9),
    tile_cols=st.integers(1, 12),
    item=st.sampled_from([1, 2, 4]),
)
def test_contiguous_digest_units_hash_the_bytes_units_of_names(shape, tile_rows, tile_cols, item) -> None:
    """The publisher's fast path (``_contiguous_units``, memoised per geometry, the tensor's array hashed
    in place) gives every unit's xxh3 at its slot, for each geometry without row digests."""
    dtype = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[item]
    rows = shape[-2] if len(shape) >= 2 else 1
    cols = shape[-1] if shape else 1
    tile_rows, tile_cols = min(tile_rows, rows), min(tile_cols, cols)
    if tile_cols < cols and (tile_cols * item) % 8:
        tile_cols = cols  # column ranges are whole 8-byte words
    t = Tiling("xxh3", shape, item, tile_rows, tile_cols)
    if t.row_digests:
        tile_rows = 1
        t = Tiling("xxh3", shape, item, tile_rows, tile_cols)
    x = _random(tuple(shape), dtype, seed=len(shape) * 31 + tile_rows)
    flat = x.reshape(-1).view(torch.uint8).numpy().tobytes()
    want = np.zeros(t.count, dtype=np.uint64)
    for u in units_of(t, tuple((0, d) for d in shape)):
        want[u.slot] = xxhash.xxh3_64_intdigest(flat[u.lo : u.lo + u.covered])
    assert np.array_equal(shard_digests(x, t), want)
