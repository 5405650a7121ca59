"""docs/registry.md's example (a registry service, string addresses, one process) and release policies."""

from __future__ import annotations

import anyio
import pytest
import torch

import refitflow as rf
from refitflow.core.wire import PROTOCOL_VERSION
from refitflow.registry.release import ReleasePolicy


@pytest.mark.asyncio
async def test_quickstart_through_registry_service_and_addresses() -> None:
    with anyio.fail_after(30):
        identity = rf.Identity(model="tiny")
        weights = {"w": torch.arange(12, dtype=torch.float32).reshape(4, 3), "b": torch.ones(3)}
        model = {"w": torch.zeros(4, 3), "b": torch.zeros(3)}
        async with rf.Registry.serve("tcp://127.0.0.1:*") as server:
            async with (  # transport "auto": NIXL, as between processes
                rf.Publisher(server.address, identity=identity) as pub,
                rf.Receiver(model, server.address, identity=identity) as rcv,
            ):
                assert pub.transport.name == "nixl"
                await pub.publish(1, weights)
                result = await rcv.refit(timeout=10)
                assert result.version == 1
                assert torch.equal(model["w"], weights["w"]) and torch.equal(model["b"], weights["b"])
                await pub.released(1, timeout=10)
            assert await server.registry.is_released(identity, 1)


@pytest.mark.asyncio
async def test_release_policy_after_timeout_releases_without_acks() -> None:
    with anyio.fail_after(30):
        identity = rf.Identity(model="tiny")
        registry = rf.Registry()
        await registry.register_receiver(identity, "silent")
        async with rf.Publisher(registry, identity=identity, release_policy=ReleasePolicy(after_s=0.2)) as pub:
            await pub.publish(1, {"w": torch.ones(2)})
            assert not await registry.is_released(identity, 1)
            await pub.released(1, timeout=5)


@pytest.mark.asyncio
async def test_release_policy_count_needs_that_many_receivers() -> None:
    with anyio.fail_after(30):
        identity = rf.Identity(model="tiny")
        registry = rf.Registry()
        for rid in ("a", "b", "c"):
            await registry.register_receiver(identity, rid)
        async with rf.Publisher(registry, identity=identity, release_policy=ReleasePolicy(receivers=2)) as pub:
            await pub.publish(1, {"w": torch.ones(2)})
            await registry.report(identity, "a", 1)
            assert not await registry.is_released(identity, 1, policy=pub.release_policy)
            await registry.report(identity, "b", 1)
            await pub.released(1, timeout=5)
            assert not await registry.is_released(identity, 1)  # the default policy still waits for "c"


@pytest.mark.asyncio
async def test_released_early_by_policy_then_changed_bytes_never_commit() -> None:
    """ReleasePolicy(after_s=0): the trainer may change a version nobody read yet; a receiver that
    reads it then fails its integrity check, keeps serving its old bytes (shadow), and the next
    version commits."""
    registry, ident = rf.Registry(), rf.Identity(model="early")
    trainer = {"w": torch.randn(64, 64), "b": torch.randn(64)}
    server = {n: torch.zeros_like(t) for n, t in trainer.items()}
    with anyio.fail_after(20):
        async with (
            rf.Publisher(registry, identity=ident, release_policy=ReleasePolicy(after_s=0)) as pub,
            rf.Receiver(server, registry, identity=ident, mode="shadow") as recv,
        ):
            await pub.publish(1, trainer)
            await pub.released(1, timeout=1)  # released by time alone: the receiver read nothing yet
            trainer["w"].add_(1.0)  # the next training step, in place
            with pytest.raises(rf.IntegrityError):
                await recv.refit(1)
            assert recv.fence.state == "ready" and all(torch.equal(t, torch.zeros_like(t)) for t in server.values())
            await pub.publish(2, trainer)
            await recv.refit(2)
            assert all(torch.equal(server[n], trainer[n]) for n in trainer)


@pytest.mark.asyncio
async def test_a_flood_of_requests_is_answered_busy_not_piled_up() -> None:
    import orjson
    import zmq
    import zmq.asyncio

    ident = {"model": "flood", "layout": "hf", "dtype": "any", "parallelism": "any", "compile_target": "hf_raw"}
    with anyio.fail_after(20):
        async with rf.Registry.serve(
            "tcp://127.0.0.1:*", limits=rf.RegistryLimits(max_in_flight=3, max_in_flight_per_client=3)
        ) as server:
            ctx = zmq.asyncio.Context()
            dealer = ctx.socket(zmq.DEALER)
            dealer.connect(server.address)
            try:
                v = PROTOCOL_VERSION
                await dealer.send(orjson.dumps({"v": v, "id": "r", "op": "register_receiver", "identity": ident,
                                                "receiver_id": "r"}))  # fmt: skip
                await dealer.recv()  # so version 1 is not released: every wait below is held
                for k in range(8):
                    await dealer.send(orjson.dumps({"v": v, "id": k, "op": "wait_released", "identity": ident,
                                                    "version": 1, "wait_s": 1.0}))  # fmt: skip
                replies = [orjson.loads(await dealer.recv()) for _ in range(8)]
            finally:
                dealer.close(linger=0)
                ctx.term()
    busy = [r for r in replies if not r["ok"] and "busy" in r["message"]]
    assert len(busy) == 5 and all(r["error"] == "RefitTimeoutError" for r in busy)
    assert replies[:5] == busy  # answered at once, before the three held requests
    assert sorted(r["result"] for r in replies[5:]) == [False, False, False]  # held, then not released
