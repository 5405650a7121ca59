"""Registry outages: nothing a publisher offered or a receiver reported is lost, and nothing stale comes back.

The first test is the whole scenario with real processes (a registry process killed and restarted on
the same address, a NIXL publisher and a NIXL receiver across the outage); the others pin each part
down in one process where that is enough.
"""

from __future__ import annotations

import asyncio
import signal
from contextlib import AsyncExitStack

import anyio
import pytest
import torch

import refitflow as rf
from refitflow.core.wire import manifest_to_dict
from refitflow.registry.client.channel import Channel, Unsent
from refitflow.registry.client.client import RegistryClient
from tests.faults._registry_children import IDENTITY, RegistryChild
from tests.faults._util import free_address, spawn_registry, until
from tests.registry._procs import stop
from tests.registry.test_registry_client import ID, manifest
from tests.registry.test_registry_leases import Clock


@pytest.mark.usefixtures("store")
@pytest.mark.asyncio
async def test_registry_restart_loses_nothing_across_processes() -> None:
    """Killed for longer than the clients' request timeout, restarted on the same address: the publisher
    re-offers the version the receiver still needs, the receiver is registered again, ``released`` waits
    for it (not for a registry that forgot it), and announcements reach the receiver again."""
    address = free_address()
    procs = []
    try:
        with anyio.fail_after(240):
            procs.append(await spawn_registry(address, "--lease-s", "8"))
            async with (
                RegistryChild("publisher", address) as pub,
                RegistryChild("receiver", address, "2.0") as rx,  # heartbeats (and so returns) slowly
                RegistryClient(address, request_timeout_s=2) as probe,
            ):
                await pub.ask(publish=1, seed=1)
                assert await rx.ask(refit=1, seed=1) == {"version": 1, "exact": True}
                await pub.ask(publish=2, seed=2)  # the receiver needs it and has not read it yet

                procs[0].send_signal(signal.SIGKILL)
                await procs[0].wait()
                await until(lambda: _not_answering(pub), 30, "the publisher's requests time out")
                procs.append(await spawn_registry(address, "--lease-s", "8"))

                async def reoffered() -> bool:
                    return 2 in await probe.versions(IDENTITY)

                async def reregistered() -> bool:
                    return await probe.acked(IDENTITY, 2) == (0, 1)

                await until(reoffered, 30, "version 2 re-offered by the publisher")
                await pub.ask(release=2)  # most likely before the receiver is back: it must not count as gone
                await until(reregistered, 30, "the receiver registered again, with its report of version 1")
                assert (await pub.ask(status=True))["released"] == []
                announced = (await rx.ask(status=True))["announcements"]
                assert await rx.ask(refit=2, seed=2) == {"version": 2, "exact": True}
                await until(lambda: _released(pub, 2), 30, "version 2 released once the receiver read it")

                await pub.ask(publish=3, seed=3)
                await until(lambda: _announced(rx, announced), 30, "an announcement after the restart")
                assert await rx.ask(refit=3, seed=3) == {"version": 3, "exact": True}
    finally:
        await stop(*procs)


async def _not_answering(child: RegistryChild) -> bool:
    return not (await child.ask(status=True))["answering"]


async def _released(child: RegistryChild, version: int) -> bool:
    return version in (await child.ask(status=True))["released"]


async def _announced(child: RegistryChild, before: int) -> bool:
    return int((await child.ask(status=True))["announcements"]) > before


@pytest.mark.asyncio
async def test_a_request_given_up_on_never_reaches_the_restarted_registry(store: str) -> None:
    """The channel alone (nothing held): a request queued while the registry was down is dropped with it (on
    etcd the restarted registry still holds version 1: its state is etcd's)."""
    address = free_address()
    with anyio.fail_after(60):
        channel = Channel(address, request_timeout_s=0.5, security=None, context=None)
        try:
            async with rf.Registry.serve(address) as first:
                await channel.request("publish", manifest=manifest_to_dict(manifest(1, 0, world=1)), owner="c")
                assert first.registry.newest_complete(ID) == 1
            with pytest.raises(rf.RefitTimeoutError):
                await channel.request("publish", manifest=manifest_to_dict(manifest(2, 0, world=1)), owner="c")
            async with rf.Registry.serve(address) as second:
                hello: dict = {}

                async def answered() -> bool:  # a refusal the DEALER saw before the restart may come first
                    try:
                        hello.update(await channel.request("hello"))
                    except Unsent:
                        return False  # never sent (the channel's contract): again once a connection is up
                    return True

                await until(answered, 10, "the restarted registry answers hello")
                assert hello["incarnation"] == second.incarnation
                assert await second.registry.versions(ID) == ([] if store == "memory" else [1])  # 2 never arrived
        finally:
            await channel.aclose()


@pytest.mark.usefixtures("store")
@pytest.mark.asyncio
async def test_a_publish_the_registry_did_not_answer_is_held_and_announced_when_it_is_back() -> None:
    address = free_address()
    with anyio.fail_after(60):
        async with RegistryClient(address, request_timeout_s=0.5) as client:
            async with rf.Registry.serve(address) as first:
                await client.publish(manifest(1, 0, world=1))
                assert first.registry.newest_complete(ID) == 1
            with pytest.raises(rf.RefitTimeoutError, match="held"):
                await client.publish(manifest(2, 0, world=1))  # the registry is down: held
            async with rf.Registry.serve(address) as second:
                found = await client.wait_complete(ID, 2, 20)
                assert found.version == 2
                assert 2 in await second.registry.versions(ID)


@pytest.mark.usefixtures("store")
@pytest.mark.asyncio
async def test_a_stalled_registry_does_not_carry_out_requests_its_client_gave_up_on() -> None:
    address = free_address()
    registry = await spawn_registry(address)
    try:
        with anyio.fail_after(60):
            channel = Channel(address, request_timeout_s=0.5, security=None, context=None)
            try:
                await channel.request("hello")  # learns the registry's incarnation and clock
                registry.send_signal(signal.SIGSTOP)
                with pytest.raises(rf.RefitTimeoutError):  # queued on a live connection, given up
                    await channel.request("publish", manifest=manifest_to_dict(manifest(1, 0, world=1)), owner="c")
                registry.send_signal(signal.SIGCONT)
            finally:
                await channel.aclose()
            async with RegistryClient(address, request_timeout_s=10) as probe:
                assert await probe.versions(ID) == []  # the stale publish arrived past its deadline: refused
    finally:
        registry.send_signal(signal.SIGCONT)
        await stop(registry)


@pytest.mark.usefixtures("store")
@pytest.mark.asyncio
async def test_every_held_version_is_reannounced_not_only_the_newest() -> None:
    address = free_address()
    with anyio.fail_after(60):
        async with (
            RegistryClient(address, heartbeat_s=0.1) as publisher,
            RegistryClient(address, heartbeat_s=0.1) as receiver,
        ):
            async with rf.Registry.serve(address) as first:
                await receiver.register_receiver(ID, "rx")
                await receiver.report(ID, "rx", 1)
                for version in (1, 2, 3):
                    await publisher.publish(manifest(version, 0, world=1))
                assert await first.registry.versions(ID) == [2, 3]  # 1: released and superseded
                assert await publisher.is_released(ID, 1)  # as a Publisher asks: 1 is never offered again
            async with rf.Registry.serve(address) as second:

                async def back() -> bool:
                    return await second.registry.versions(ID) == [2, 3] and await second.registry.acked(ID, 1) == (1, 1)

                await until(back, 20, "versions 2 and 3 re-announced, the receiver back with its report")
                assert not await second.registry.is_released(ID, 2)  # the receiver still needs 2


@pytest.mark.usefixtures("store")
@pytest.mark.asyncio
async def test_refit_commits_without_waiting_for_a_registry_that_is_down_and_reports_on_its_return() -> None:
    address, identity = free_address(), rf.Identity(model="down")
    weights = {"w": torch.arange(12, dtype=torch.float32).reshape(4, 3)}
    model = {"w": torch.zeros(4, 3)}
    with anyio.fail_after(90):
        async with (
            RegistryClient(address, request_timeout_s=30, heartbeat_s=0.1) as trainer,
            RegistryClient(address, request_timeout_s=30, heartbeat_s=0.1) as rollout,
            rf.Publisher(trainer, identity=identity) as pub,
            AsyncExitStack() as stack,
        ):
            async with rf.Registry.serve(address):
                rcv = await stack.enter_async_context(rf.Receiver(model, rollout, identity=identity))
                await pub.publish(1, weights)
                txn, _ = await rcv.prepare(1, timeout=10)
            with anyio.fail_after(10):  # far less than the 30 s a request to the absent registry may wait
                await rcv.finish(txn)
            assert rcv.status.committed_version == 1 and torch.equal(model["w"], weights["w"])
            async with rf.Registry.serve(address) as back:
                await pub.released(1, timeout=30)  # needs the report, delivered to the new registry
                assert await back.registry.acked(identity, 1) == (1, 1)
                await stack.aclose()


@pytest.mark.asyncio
async def test_a_restarted_registry_holds_releases_until_receivers_can_return() -> None:
    with anyio.fail_after(10):
        clock = Clock()
        store = rf.Registry(lease_s=2.0, clock=clock)
        await store.publish(manifest(1, 0, world=1), owner="trainer")
        assert await store.is_released(ID, 1)  # no receiver: released at once
        store.hold_releases(2.0)  # a client of the previous incarnation came back
        assert not await store.is_released(ID, 1)
        assert await store.is_released(ID, 1, policy=rf.ReleasePolicy(receivers=1)) is False
        await store.register_receiver(ID, "rx")
        await store.report(ID, "rx", 1)
        assert await store.is_released(ID, 1, policy=rf.ReleasePolicy(receivers=1))  # a count still releases
        assert not await store.is_released(ID, 1)  # "every receiver": not while others may be on their way
        waiting = asyncio.create_task(store.wait_released(ID, 1, timeout=5))
        await asyncio.sleep(0)
        assert not waiting.done()
        clock.now = 2.5
        await waiting  # woken at the end of the hold, not by a change
        assert await store.is_released(ID, 1)


@pytest.mark.asyncio
async def test_announcements_keep_their_address_across_a_restart(store: str) -> None:
    """In memory a restart is a new incarnation; on etcd the incarnation is the store's: a replica restarted (or
    another one) is no restart to its clients."""
    address = free_address()
    with anyio.fail_after(30):
        async with rf.Registry.serve(address) as first:
            pub_address, incarnation = first.pub_address, first.incarnation
        async with rf.Registry.serve(address) as second:
            assert second.pub_address == pub_address
            assert (second.incarnation != incarnation) == (store == "memory")
