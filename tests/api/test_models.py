"""Tied weights, sharded publishers and large tensors pulled in pieces."""

from __future__ import annotations

import anyio
import pytest
import torch

import refitflow as rf
from tests.conftest import params, same


class TiedLM(torch.nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(32, 16)
        self.body = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 32, bias=False)
        self.head.weight = self.embed.weight  # tied


@pytest.mark.asyncio
@pytest.mark.parametrize("publish_alias", [False, True])
async def test_tied_weights_count_once(ident, registry, publish_alias: bool) -> None:
    trainer, server = TiedLM(1), TiedLM(2)
    tensors = dict(trainer.named_parameters(remove_duplicate=not publish_alias))
    assert ("head.weight" in tensors) is publish_alias
    with anyio.fail_after(20):
        async with (
            rf.Publisher(registry, identity=ident) as pub,
            rf.Receiver(server, registry, identity=ident, mode="shadow") as recv,
        ):
            await pub.publish(1, tensors)
            await recv.refit(1)
    assert same(server, params(trainer))
    assert server.head.weight is server.embed.weight  # still tied after the shadow swap


@pytest.mark.asyncio
@pytest.mark.parametrize("axis", [0, 1])
async def test_two_publisher_ranks_shards_are_stitched(ident, registry, axis: int) -> None:
    full = {"w": torch.randn(64, 48), "b": torch.randn(64)}
    server = {"w": torch.zeros(64, 48), "b": torch.zeros(64)}
    halves = [slice(0, 20), slice(20, None)] if axis == 0 else [slice(0, 30), slice(30, None)]
    with anyio.fail_after(20):
        async with (
            rf.Publisher(registry, identity=ident, rank=0, world_size=2) as p0,
            rf.Publisher(registry, identity=ident, rank=1, world_size=2) as p1,
            rf.Receiver(server, registry, identity=ident, budget_bytes=4096) as recv,
        ):
            for rank, (pub, sl) in enumerate(zip((p0, p1), halves, strict=True)):
                part = full["w"][sl].contiguous() if axis == 0 else full["w"][:, sl].contiguous()
                shard = rf.Sharded(tensor=part, axis=axis, start=sl.start, global_shape=(64, 48))
                tensors: dict = {"w": shard}
                if rank == 0:
                    tensors["b"] = full["b"]  # held by one rank only
                if rank == 0:
                    await pub.publish(1, tensors)
                    assert await registry.latest(ident) is None  # incomplete: not discoverable
                else:
                    await pub.publish(1, tensors)
            result = await recv.refit(1)
    assert same(server, full)
    assert result.direct_bytes == (full["w"].nbytes + full["b"].nbytes if axis == 0 else full["b"].nbytes)


@pytest.mark.asyncio
async def test_gap_between_shards_is_a_plan_error(ident, registry) -> None:
    server = {"w": torch.zeros(16, 4)}
    async with (
        rf.Publisher(registry, identity=ident, rank=0, world_size=1) as pub,
        rf.Receiver(server, registry, identity=ident) as recv,
    ):
        await pub.publish(1, {"w": rf.Sharded(tensor=torch.ones(4, 4), axis=0, start=0, global_shape=(16, 4))})
        with anyio.fail_after(10), pytest.raises(rf.PlanError, match=r"coverage gap in w axis 0 \[4, 16\)"):
            await recv.refit(1)


@pytest.mark.asyncio
async def test_tensor_larger_than_budget_is_pulled_in_pieces(ident, registry) -> None:
    big = torch.randn(3, 100, 70).to(torch.bfloat16)  # 42 KB; one row of dim 0 alone exceeds the bucket
    server = {"big": torch.zeros(3, 100, 70)}
    async with (
        rf.Publisher(registry, identity=ident) as pub,
        rf.Receiver(server, registry, identity=ident, budget_bytes=4096, bucket_bytes=1024) as recv,
    ):
        await pub.publish(1, {"big": big})
        with anyio.fail_after(20):
            result = await recv.refit(1)
    assert torch.equal(server["big"], big.float())
    assert result.stages["pull"].items >= big.nbytes // 1024 and result.peak_staging_bytes <= 4096


@pytest.mark.asyncio
async def test_second_refit_replays_the_cached_plan(ident, registry) -> None:
    trainer = {f"t{i}": torch.randn(32, 32) for i in range(20)}
    server = {n: torch.zeros_like(t) for n, t in trainer.items()}
    async with (
        rf.Publisher(registry, identity=ident) as pub,
        rf.Receiver(server, registry, identity=ident) as recv,
    ):
        with anyio.fail_after(20):
            await pub.publish(1, trainer)
            first = await recv.refit(1)
            await pub.released(1, timeout=5)
            for t in trainer.values():
                t.mul_(2)
            await pub.publish(2, trainer)
            second = await recv.refit(2)
    assert not first.plan_cached and second.plan_cached
    assert same(server, trainer)
