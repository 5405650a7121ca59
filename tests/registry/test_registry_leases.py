"""Leases on the embedded registry, with a fake clock: what a stale owner held stops counting."""

from __future__ import annotations

import anyio
import pytest

import refitflow as rf
from tests.registry.test_registry_client import ID, manifest


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.asyncio
async def test_stale_owner_loses_its_versions_and_receivers_but_a_live_one_keeps_them() -> None:
    with anyio.fail_after(10):
        clock = Clock()
        registry = rf.Registry(lease_s=1.0, clock=clock)
        await registry.publish(manifest(1, 0), owner="trainer-a")
        await registry.publish(manifest(1, 1), owner="trainer-b")
        await registry.register_receiver(ID, "rx", owner="rollout")
        clock.now = 0.9
        assert await registry.heartbeat("trainer-a") and await registry.heartbeat("trainer-b")
        clock.now = 1.5
        assert registry.expire() == ["rollout"]
        assert (await registry.latest(ID)) is not None and await registry.is_released(ID, 1)
        clock.now = 2.0
        assert await registry.heartbeat("trainer-a")
        assert registry.expire() == ["trainer-b"]
        assert await registry.latest(ID) is None and await registry.versions(ID) == [1]  # rank 0 only
        assert not await registry.heartbeat("trainer-b")  # unknown now: its client re-announces
        await registry.publish(manifest(1, 1), owner="trainer-b")
        assert (await registry.latest(ID)).version == 1  # type: ignore[union-attr]


@pytest.mark.asyncio
async def test_an_owner_record_forgets_dropped_versions() -> None:
    with anyio.fail_after(10):
        registry = rf.Registry()
        for version in range(200):
            await registry.publish(manifest(version, 0, world=1), owner="trainer")
        assert await registry.versions(ID) == [199]
        assert len(registry._owned["trainer"]) <= 64
