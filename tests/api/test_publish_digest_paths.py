"""The publisher's digest pass takes a short path for a CPU shard that is one xxh3 unit (most small tensors:
norms, biases, small projections): its fields must be exactly those of the general path."""

from __future__ import annotations

import pytest
import torch

from refitflow.api.digesting import _digest_all, _fields, _tiling
from refitflow.core.hashing import shard_digests

CASES = [
    ((1024,), torch.float32), ((7,), torch.bfloat16), ((3, 5), torch.float16), ((64, 4), torch.float32),
    ((), torch.float32), ((), torch.bfloat16), ((6, 4), torch.int8), ((16,), torch.float8_e4m3fn),
    ((5,), torch.float64), ((9,), torch.int64), ((4, 4), torch.uint8),
]  # fmt: skip


@pytest.mark.parametrize(("shape", "dtype"), CASES)
@pytest.mark.parametrize("grad", [False, True])
def test_one_unit_shards_get_the_fields_of_the_general_path(shape: tuple[int, ...], dtype: torch.dtype,
                                                            grad: bool) -> None:  # fmt: skip
    torch.manual_seed(len(shape) + dtype.itemsize)
    t = torch.randn(shape).mul(50).to(dtype)
    if grad and dtype.is_floating_point and dtype != torch.float8_e4m3fn:
        t.requires_grad_(True)
    tiling = _tiling(t, "xxh3")
    assert tiling.count == 1 and tiling.tile_rows  # the short path's case
    (fields,) = _digest_all([(t, "xxh3")])
    assert fields == _fields(tiling, shard_digests(t.detach(), tiling))
    flipped = t.detach().clone()
    flipped.reshape(-1).view(torch.uint8)[0] ^= 1  # one bit of its first byte
    assert _digest_all([(flipped, "xxh3")])[0][-1] != fields[-1]  # the digest


def test_a_shard_of_many_units_takes_the_general_path_and_agrees_with_it() -> None:
    t = torch.randn(4096, 1024)
    tiling = _tiling(t, "xxh3")
    assert tiling.count > 1
    assert _digest_all([(t, "xxh3")]) == [_fields(tiling, shard_digests(t, tiling))]
