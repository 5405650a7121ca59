"""Two-phase publication across real processes (registry service, NIXL publishers, a NIXL receiver): a
publisher that dies between announcing a version's layout and its digests costs that version's refit
and nothing else — the receiver keeps serving its last version, and the next version commits. Each rank has
one live publisher at a time: the first closes before the doomed one starts, and the third publishes once
the doomed one's lease ran out (before, the registry refuses it, saying why)."""

from __future__ import annotations

import anyio
import pytest

from tests.faults._registry_children import RegistryChild
from tests.faults._util import free_address, spawn_registry
from tests.registry._procs import stop


@pytest.mark.usefixtures("store")
@pytest.mark.asyncio
async def test_a_publisher_that_dies_between_its_two_announcements_costs_one_refit_and_nothing_else() -> None:
    address = free_address()
    procs = []
    try:
        with anyio.fail_after(180):
            procs.append(await spawn_registry(address, "--lease-s", "2"))
            async with RegistryChild("receiver", address) as rx:
                async with RegistryChild("publisher", address, "early") as first:
                    await first.ask(publish=1, seed=1)
                    assert await rx.ask(refit=1, seed=1) == {"version": 1, "exact": True}
                async with RegistryChild("publisher", address, "dies-after-announcing") as doomed:
                    assert await doomed.ask(publish=2, seed=2) == {"announced": True}
                    failed = await rx.ask(refit=2, seed=2)  # read early from a process that is gone
                    assert doomed.proc is not None and await doomed.proc.wait() == 7
                assert failed.get("error") in ("TransportError", "RefitTimeoutError"), failed
                status = await rx.ask(status=True)
                assert status["committed"] == 1 and status["fence"] == "ready", status  # shadow: still serving 1
                await anyio.sleep(3.0)  # the doomed publisher's lease (2 s) runs out: its rank is free
                async with RegistryChild("publisher", address, "early") as third:
                    await third.ask(publish=3, seed=3)
                    assert await rx.ask(refit=3, seed=3) == {"version": 3, "exact": True}
    finally:
        await stop(*procs)
