"""Staging per device: buckets stage on one device, each device's ring is a share of one budget.

This machine has one device, so the second device is ``meta``: a real torch device whose tensors have
no bytes. The planner reads only names, shapes, dtypes and devices, and the rings' bookkeeping never
reads staging bytes, so both are tested directly here; a destination spread over CPU and CUDA runs
end to end in test_device_path.py (``split-model``) with ``--device cuda``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import anyio
import pytest
import torch

import refitflow as rf
from refitflow.planner.build import build_plan
from refitflow.refit.arena import StagingArenas
from refitflow.refit.config import ReceiverConfig

SHAPE = (64, 64)


@dataclass
class TwoDeviceLanding:
    """A destination over two devices, as the planner sees it (stages._context.Landing)."""

    params: dict[str, torch.Tensor]
    canonical: dict[str, str] = field(default_factory=dict)
    quantised: dict[str, object] = field(default_factory=dict)
    scales: frozenset[str] = frozenset()
    expected: dict[str, int] = field(default_factory=dict)
    layout: None = None
    layout_key: None = None
    generation: int = 0

    def __post_init__(self) -> None:
        self.canonical = {n: n for n in self.params}


def _pub(names: list[str]) -> rf.Publication:
    ident = rf.Identity(model="m")
    shards = tuple(
        rf.ShardSpec(
            name=n, dtype="bfloat16", global_shape=SHAPE, axis=None, start=0, stop=SHAPE[0], digest="0" * 16, region=i
        )
        for i, n in enumerate(names)
    )
    source = rf.SourceAddress(transport="loopback", agent="a0")
    manifest = rf.Manifest(identity=ident, version=1, rank=0, world_size=1, source=source, shards=shards)
    return rf.Publication(identity=ident, version=1, manifests=(manifest,))


def test_a_bucket_stages_on_one_device_and_names_every_device_it_touches() -> None:
    devices = {"a": "cpu", "b": "meta", "c": "meta", "d": "cpu", "e": "cpu"}
    landing = TwoDeviceLanding({n: torch.empty(SHAPE, device=d) for n, d in devices.items()})  # fp32: staged
    direct = {"f": torch.empty(SHAPE, dtype=torch.bfloat16, device="meta")}  # bf16: lands directly
    landing = TwoDeviceLanding(landing.params | direct)
    limits = ReceiverConfig(budget_bytes=1 << 20, bucket_bytes=1 << 20).limits  # all would fit one bucket
    plan = build_plan(_pub([*devices, "f"]), landing, limits)  # type: ignore[arg-type]
    staged = [[p.device for p in b.pieces if not p.direct] for b in plan.buckets]
    assert [set(s) for s in staged if s] == [{"cpu"}, {"meta"}, {"cpu"}]  # cut where the staging device changes
    for bucket in plan.buckets:
        if bucket.staging_bytes:
            assert {p.device for p in bucket.pieces if not p.direct} == {bucket.device}
        touched = {p.device for p in bucket.pieces} | {devices.get(s.param, "meta") for p in bucket.pieces
                                                       for s in p.scatters}  # fmt: skip
        assert set(bucket.devices) == touched
    (f,) = [p for b in plan.buckets for p in b.pieces if p.direct]
    assert f.device == "meta" and f.scatters[0].param == "f"


@pytest.mark.asyncio
async def test_each_device_ring_is_a_share_of_one_budget() -> None:
    budget = rf.ByteBudget(1000)
    arenas = StagingArenas(budget, ["cpu", "meta"])
    assert arenas.share == 500 and arenas.allocated_bytes == 0
    with anyio.fail_after(5):
        a = await arenas.allocate(300, "cpu")
        b = await arenas.allocate(400, "meta")
        assert (a.view.device.type, b.view.device.type) == ("cpu", "meta") and (a.offset, b.offset) == (0, 0)
        assert budget.statistics().used_bytes == 700 and arenas.allocated_bytes == 1000  # never above the budget
        with pytest.raises(rf.ConfigError, match="can never fit the 500-byte staging ring on meta"):
            await arenas.allocate(501, "meta")
        with pytest.raises(rf.ConfigError, match="no staging on cuda:0"):
            await arenas.allocate(10, "cuda:0")
        arenas.free(b)
        c = await arenas.allocate(500, "meta")  # the meta ring is empty again: its whole share
        assert budget.statistics().used_bytes == 800 and c.offset == 0
        arenas.free_all()
    assert budget.statistics().used_bytes == 0


def test_a_receiver_on_one_device_keeps_the_whole_budget_for_its_ring(ident, registry) -> None:
    recv = rf.Receiver({"w": torch.zeros(8, 8)}, registry, identity=ident, budget_bytes=4096, bucket_bytes=4096)
    assert recv.devices.devices == (torch.device("cpu"),) and recv.limits.bucket_bytes == 4096
