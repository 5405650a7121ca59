"""Block digests under layouts: partial pulls, corrupted bytes, fused parameters across many buckets."""

from __future__ import annotations

import anyio
import pytest
import torch

import refitflow as rf
from refitflow.layouts import canonical_shapes, hf
from refitflow.layouts.canonical import from_canonical, to_canonical
from tests.layouts._models import _model, _refit


@pytest.mark.asyncio
async def test_pulled_mode_reports_unverified_bytes_of_column_slices() -> None:
    trainer = _model("llama", 2)
    with anyio.fail_after(30):
        _, _, strict = await _refit(trainer, (1, 1), (2, 1))
        # descriptor_bytes=0: the column slices as such (their whole rows would be whole blocks, all verified)
        _, _, pulled = await _refit(trainer, (1, 1), (2, 1), verify="pulled", descriptor_bytes=0)
    assert all(r.unverified_bytes == 0 for r in strict)
    assert all(r.nbytes > r.ideal_bytes for r in strict)  # strict widened the column slices to whole blocks
    # o_proj / down_proj column slices cannot be checked against row blocks
    assert all(0 < r.unverified_bytes < r.nbytes and r.nbytes == r.ideal_bytes for r in pulled)
    with anyio.fail_after(30):  # by default their whole rows are read (fewer bytes than the descriptors saved):
        _, _, rows = await _refit(trainer, (1, 1), (2, 1), verify="pulled")  # whole row blocks, verified
    for r, exact in zip(rows, pulled, strict=True):
        assert r.unverified_bytes < exact.unverified_bytes and r.nbytes > r.ideal_bytes == exact.ideal_bytes


@pytest.mark.asyncio
async def test_fused_parameters_assembled_across_many_small_buckets() -> None:
    trainer = _model("qwen2", 2)
    with anyio.fail_after(30):
        ranks, maps, results = await _refit(trainer, (2, 1), (4, 1), budget_bytes=4096, bucket_bytes=1024)
    assert all(r.stages["pull"].items > 20 for r in results)
    d = hf.dims_from_config(trainer.config)
    canon = to_canonical(list(zip(maps, ranks, strict=True)), canonical_shapes(d))
    got = from_canonical(hf.layout(d), canon)
    assert all(torch.equal(got[n], t.float()) for n, t in trainer.state_dict().items())


@pytest.mark.asyncio
async def test_a_changed_trainer_byte_is_an_integrity_error() -> None:
    def tamper(shards: dict[str, torch.Tensor]) -> None:
        shards["decoder.layers.1.mlp.linear_fc2.weight"][5, 70] += 1  # written after the digest

    with anyio.fail_after(30), pytest.raises(rf.IntegrityError) as info:
        await _refit(_model("llama", 2), (1, 1), (2, 1), tamper=tamper)
    assert info.value.tensor == "decoder.layers.1.mlp.linear_fc2.weight"
