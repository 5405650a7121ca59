"""Shards of one geometry share their planned pieces (stages._pieces, memoised per build) but keep their
own names, devices and landing offsets."""

from __future__ import annotations

import base64

import torch

import refitflow as rf
from refitflow.core.digests import Tiling, choose_tiling
from refitflow.layouts.boxes import volume
from refitflow.planner.build import build_plan
from refitflow.refit.config import ReceiverConfig
from refitflow.refit.destination import ApplyMode, Destination

SHAPE = (96, 64)


def _pub(names: list[str]) -> rf.Publication:
    """Two trainer ranks, each holding half the rows of every tensor (bf16, the publisher's tiles)."""
    ident = rf.Identity(model="m")
    half = SHAPE[0] // 2
    rows, cols = choose_tiling((half, SHAPE[1]), 2)
    blocks = base64.b64encode(bytes(8 * Tiling("xxh3", (half, SHAPE[1]), 2, rows, cols).count)).decode()
    manifests = []
    for r in range(2):
        span = {"axis": 0, "start": r * half, "stop": (r + 1) * half, "tile_rows": rows, "tile_cols": cols}
        shards = tuple(
            rf.ShardSpec(name=n, dtype="bfloat16", global_shape=SHAPE, digest="0" * 16, region=i, blocks=blocks, **span)
            for i, n in enumerate(names)
        )
        source = rf.SourceAddress(transport="loopback", agent=f"a{r}")
        manifests.append(rf.Manifest(identity=ident, version=1, rank=r, world_size=2, shards=shards, source=source))
    return rf.Publication(identity=ident, version=1, manifests=tuple(manifests))


def test_shards_of_one_geometry_keep_their_names_devices_and_offsets() -> None:
    names = [f"layer{i}.w" for i in range(12)]
    # alternate devices and dtypes: the shared geometry must not carry one tensor's device or cast to another
    params = {
        n: torch.empty(SHAPE, dtype=torch.bfloat16 if i % 3 else torch.float32, device="meta" if i % 2 else "cpu")
        for i, n in enumerate(names)
    }
    plan = build_plan(_pub(names), Destination(params, ApplyMode.IN_PLACE), ReceiverConfig().limits)
    covered = dict.fromkeys(names, 0)
    for b in plan.buckets:
        for p in b.pieces:
            assert {s.param for s in p.scatters} == {p.tensor}, p
            t = params[p.tensor]
            assert p.direct == (t.dtype == torch.bfloat16)  # a cast is staged
            assert p.device == str(t.device)  # staged: the ring of its parameter's device
            if p.direct:  # the piece's own rows of its own parameter
                assert p.landing_offset == p.scatters[0].dbox[0][0] * SHAPE[1] * t.element_size()
            covered[p.tensor] += sum(volume(s.dbox) for s in p.scatters)
    assert covered == dict.fromkeys(names, SHAPE[0] * SHAPE[1])
