"""The registry as real processes on 127.0.0.1: one publisher process (2 ranks), two receivers."""

from __future__ import annotations

import asyncio
import signal
import time

import anyio
import pytest

from tests.registry._procs import event_of, spawn_child, spawn_registry, stop

LEASE_S = 1.0


@pytest.mark.asyncio
async def test_receivers_discover_then_lose_a_killed_publishers_version() -> None:
    procs = []
    try:
        with anyio.fail_after(60):
            registry, address = await spawn_registry("--lease-s", str(LEASE_S))
            procs.append(registry)
            publisher = await spawn_child("publisher", address)
            procs.append(publisher)
            receivers = [await spawn_child("receiver", address) for _ in range(2)]
            procs += receivers
            assert (await event_of(publisher))["event"] == "published"
            for rx in receivers:
                found = await event_of(rx)
                assert found == {"event": "discovered", "version": 1, "ranks": [0, 1], "ranges": [[0, 4], [4, 8]],
                                 "fetches": 1}  # fmt: skip
            publisher.send_signal(signal.SIGKILL)
            killed = time.monotonic()
            for rx in receivers:
                gone = await event_of(rx)
                assert gone["event"] == "gone"
                assert gone["t"] - killed < LEASE_S * 1.25 + 1.0  # lease + one expiry tick + scheduling slack
                assert gone["fetches"] == 1  # manifests fetched once per version, not per query
            assert registry.returncode is None
            registry.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(registry.wait(), 10) == 0
    finally:
        await stop(*procs)
