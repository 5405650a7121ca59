"""``Publisher(column_digests=False)``: one digest per block of rows (one pass over the trainer's bytes); receivers
holding whole rows verify every byte, a receiver that would read a column slice refuses clearly."""

from __future__ import annotations

import anyio
import pytest
import torch

import refitflow as rf
from refitflow.core.digests import choose_tiling
from refitflow.layouts.boxes import full, shape_of
from refitflow.layouts.canonical import LocalTensor, Segment


def test_rows_only_tiling_has_no_column_ranges() -> None:
    assert choose_tiling((14336, 4096), 2) == (64, 512)
    assert choose_tiling((14336, 4096), 2, columns=False) == (64, 4096)
    assert choose_tiling((1 << 24,), 2, columns=False) == (1, 1 << 21)  # 1-D: 4 MiB ranges either way


def _part(name: str, box: tuple, shape: tuple[int, ...]) -> dict[str, LocalTensor]:
    return {name: LocalTensor(shape_of(box), (Segment(name, box, full(shape_of(box)), shape),))}


@pytest.mark.asyncio
async def test_whole_rows_verify_and_a_column_slice_is_refused_naming_the_tensor() -> None:
    w = torch.randn(256, 1024).to(torch.bfloat16)
    registry, ident = rf.Registry(), rf.Identity(model="rows")
    rows = {"w": torch.zeros(128, 1024, dtype=torch.bfloat16)}
    cols = {"w": torch.zeros(256, 512, dtype=torch.bfloat16)}
    with anyio.fail_after(30):
        async with rf.Publisher(registry, identity=ident, column_digests=False) as pub:
            manifest = await pub.publish(1, {"w": w})
            assert manifest.metadata["digests"] == "rows"
            assert manifest.shards[0].tile_cols == 1024  # one range per row: one contiguous pass
            layout = _part("w", ((128, 256), (0, 1024)), (256, 1024))
            async with rf.Receiver(rows, registry, identity=ident, layout=layout) as recv:
                result = await recv.refit(1)
            assert torch.equal(rows["w"], w[128:]) and result.unverified_bytes == 0
            layout = _part("w", ((0, 256), (512, 1024)), (256, 1024))
            async with rf.Receiver(cols, registry, identity=ident, layout=layout) as recv:
                with pytest.raises(rf.PlanError, match=r"reads columns 512:1024 of 1024.*digested whole rows only"):
                    await recv.refit(1)
            assert not cols["w"].any()  # nothing was read
            with pytest.raises(rf.ConfigError, match="refitflow's"):
                await pub.publish(2, {"w": w}, metadata={"digests": "tiles"})
