"""The byte budget and the staging arena: shaped like CapacityLimiter, never exceeded."""

from __future__ import annotations

import anyio
import pytest
import torch

import refitflow as rf
from refitflow.refit.arena import StagingArena
from tests.conftest import mlp, params, same


def test_acquire_nowait_release_and_statistics() -> None:
    budget = rf.ByteBudget(100)
    budget.acquire_nowait(60)
    with pytest.raises(anyio.WouldBlock):
        budget.acquire_nowait(41)
    budget.acquire_nowait(40)
    budget.release(70)
    s = budget.statistics()
    assert (s.capacity_bytes, s.used_bytes, s.peak_bytes) == (100, 30, 100)
    with pytest.raises(RuntimeError):
        budget.release(31)
    with pytest.raises(rf.ConfigError):
        budget.acquire_nowait(101)
    with pytest.raises(rf.ConfigError):
        rf.ByteBudget(0)
    with pytest.raises(rf.ConfigError, match="unknown receiver options"):
        rf.Receiver({"w": torch.zeros(2)}, rf.Registry(), identity=rf.Identity(model="m"), budget_byte=10)
    with pytest.raises(rf.ConfigError, match="bucket_bytes"):
        rf.Receiver({"w": torch.zeros(2)}, rf.Registry(), identity=rf.Identity(model="m"), budget_bytes=1024,
                    bucket_bytes=4096)  # fmt: skip


@pytest.mark.asyncio
async def test_acquire_waits_for_release() -> None:
    budget = rf.ByteBudget(100)
    budget.acquire_nowait(80)
    got = anyio.Event()

    async def taker() -> None:
        await budget.acquire(50)
        got.set()

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(taker)
            await anyio.wait_all_tasks_blocked()
            assert not got.is_set() and budget.statistics().waiting == 1
            budget.release(80)
            await got.wait()
    assert budget.statistics().used_bytes == 50


@pytest.mark.asyncio
async def test_arena_ring_places_deterministically_and_waits_when_full() -> None:
    arena = StagingArena(rf.ByteBudget(100))
    a = await arena.allocate(40)
    b = await arena.allocate(40)
    assert (a.offset, b.offset) == (0, 40)
    blocked = anyio.Event()
    placed: list[int] = []

    async def third() -> None:
        blocked.set()
        placed.append((await arena.allocate(30)).offset)

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(third)
            await blocked.wait()
            await anyio.wait_all_tasks_blocked()
            assert placed == []  # 30 bytes do not fit after 80, nor before 0
            arena.free(a)
    assert placed == [0]  # wrapped to the start once the oldest lease was freed
    assert arena.budget.statistics().used_bytes == 70
    arena.free_all()
    assert arena.budget.statistics().used_bytes == 0


@pytest.mark.asyncio
async def test_peak_staging_never_exceeds_budget_on_a_model_32x_larger(ident, registry) -> None:
    # bf16 -> fp32 is a widening cast: every byte goes through staging
    trainer = {f"w{i}": torch.randn(256, 256).to(torch.bfloat16) for i in range(8)}  # 1 MiB
    trainer["big"] = torch.randn(1024, 512).to(torch.bfloat16)  # 1 MiB, 32x the budget alone
    server = {n: torch.zeros(t.shape, dtype=torch.float32) for n, t in trainer.items()}
    budget = 32 << 10
    model_bytes = sum(t.nbytes for t in trainer.values())
    assert model_bytes >= 32 * budget
    with anyio.fail_after(60):
        async with (
            rf.Publisher(registry, identity=ident) as pub,
            rf.Receiver(server, registry, identity=ident, budget_bytes=budget, bucket_bytes=8 << 10) as recv,
        ):
            await pub.publish(1, trainer)
            result = await recv.refit(1)
    stats = recv.budget.statistics()
    assert 0 < stats.peak_bytes <= stats.capacity_bytes == budget
    assert result.peak_staging_bytes == stats.peak_bytes and stats.used_bytes == 0
    assert result.direct_bytes == 0 and result.nbytes == model_bytes
    assert all(torch.equal(server[n], t.float()) for n, t in trainer.items())


@pytest.mark.asyncio
async def test_direct_landing_uses_no_staging(ident, registry) -> None:
    trainer, server = mlp(1), mlp(2)
    expected = params(trainer)
    for mode in ("in_place", "shadow"):
        async with (
            rf.Publisher(registry, identity=ident) as pub,
            rf.Receiver(server, registry, identity=ident, budget_bytes=4096, mode=mode) as recv,
        ):
            with anyio.fail_after(20):
                v = 1 if mode == "in_place" else 2
                await pub.publish(v, dict(trainer.named_parameters()))
                result = await recv.refit(v)
        assert same(server, expected)
        assert result.direct_bytes == result.nbytes > 0
        assert recv.budget.statistics().peak_bytes == 0
        assert recv._arena is not None and recv._arena.allocated_bytes == 0  # the arena was never even allocated
