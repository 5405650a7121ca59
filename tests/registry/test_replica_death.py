"""A registry replica that dies for good costs a client at most one request's deadline, whatever it was asking.

One 3-member etcd cluster on loopback and `refitflow registry --store etcd://…` replicas as processes (CURVE
on), shared by the module; each test is given two live replicas, and every client of the test names both, the
one to kill first (clients start there). The replica is SIGSTOPped, the request under test is sent to it
(``Channel.sent`` counts it: it is in flight there), then SIGKILLed — the worst moment: the request reached a
replica that will never answer it — and never restarted. Each kind of request a client sends or is owed must
then be carried out through the survivor within its own deadline (``Channel.lost`` says it was in flight on
the dead replica's connection when that broke), which a client given the survivor alone sees. Long polls
(``wait_released``, ``wait_complete``) are killed while they wait at the replica. Last, a trainer and a
receiver over NIXL with the replica killed mid-refit: the trainer's ``released(v)`` returns within a lease
of the receiver's commit, and the next version goes through the survivor alone (issue 53's stall).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Coroutine, Iterator
from typing import Any

import anyio
import pytest
import torch

import refitflow as rf
from refitflow.core.fanout import RelayOffer
from refitflow.registry.client.client import RegistryClient
from tests.faults._util import until
from tests.registry._etcd import free_port
from tests.registry._replicas import Deployment, Replica
from tests.registry.test_registry_client import manifest

LEASE_S = 4.0
TIMEOUT_S = 4.0  # each client request's deadline: the dead replica's share is half of it


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    d = Deployment(tmp_path_factory.mktemp("ha"), members=3, lease_s=LEASE_S)
    try:
        yield d
    finally:
        d.close()


@pytest.fixture
def pair(deployment: Deployment) -> tuple[Replica, Replica]:
    return deployment.pair()


def identity(request: pytest.FixtureRequest) -> rf.Identity:
    return rf.Identity(model=f"ha-{request.node.name}")


def client(d: Deployment, replicas: list[Replica], role: str, **options: Any) -> RegistryClient:
    return RegistryClient([r.address for r in replicas], security=d.keys.client_named(role),
                          request_timeout_s=TIMEOUT_S, **options)  # fmt: skip


async def in_flight_at_death(victim: Replica, who: RegistryClient, op: str, call: Coroutine[Any, Any, Any]) -> Any:
    """Stop ``victim``, make ``call``; once its ``op`` request went to the victim, kill it; ``call``'s result."""
    await who.hello()  # what the call asks first (``max_bytes``) is known: the call's own request goes first
    channel = who._channel.channels[0]
    assert channel.address == victim.address and channel.up, "the client must have spoken to the victim first"
    victim.stop()
    before = channel.sent[op]  # sent from now on: to a replica that answers nothing (not an answer already sent)
    task = asyncio.create_task(call)

    async def sent() -> bool:
        return channel.sent[op] > before or task.done()

    await until(sent, TIMEOUT_S, f"{op!r} sent to the stopped replica")
    victim.kill()
    result = await task
    assert channel.lost[op] >= 1, f"{op!r} was not in flight on the dead replica's connection"
    return result


def _offer(ident: rf.Identity, version: int, rid: str) -> RelayOffer:
    """An offer of no tensors; its layout is its geometry's digest, as a registry given the whole offer computes it
    (a reader of that layout is chained to it)."""
    return RelayOffer(identity=ident, version=version, receiver=rid, source=rf.SourceAddress(transport="loopback",
                      agent=rid), status=0, params=(), held=())  # fmt: skip


@pytest.mark.asyncio
@pytest.mark.parametrize("phase", ["whole", "digests"])
async def test_a_publish_in_flight_when_its_replica_dies_lands_on_the_survivor(
    deployment: Deployment, pair: tuple[Replica, Replica], phase: str, request: pytest.FixtureRequest
) -> None:
    victim, survivor = pair
    ident = identity(request)
    whole = manifest(1, 0, world=1, identity=ident)
    with anyio.fail_after(60):
        async with client(deployment, [victim, survivor], "trainer") as trainer, \
                client(deployment, [survivor], "operator") as observer:  # fmt: skip
            await trainer.hello()
            op = "publish"
            if phase == "digests":  # two-phase: the layout announced before, the digests alone in flight
                await trainer.publish(dataclasses.replace(whole, revision="", shards=(
                    dataclasses.replace(whole.shards[0], digest=""),)))  # fmt: skip
                op = "complete"
            await in_flight_at_death(victim, trainer, op, trainer.publish(whole))
            found = await observer.latest(ident)
            assert found is not None and found.version == 1 and found.manifests == (whole,)


@pytest.mark.asyncio
async def test_a_registration_in_flight_when_its_replica_dies_lands_on_the_survivor(
    deployment: Deployment, pair: tuple[Replica, Replica], request: pytest.FixtureRequest
) -> None:
    victim, survivor = pair
    ident = identity(request)
    with anyio.fail_after(60):
        async with client(deployment, [victim, survivor], "rollout") as rx, \
                client(deployment, [survivor], "operator") as observer:  # fmt: skip
            await rx.hello()
            await in_flight_at_death(victim, rx, "register_receiver", rx.register_receiver(ident, "r1"))
            assert await observer.acked(ident, 1) == (0, 1)


@pytest.mark.asyncio
@pytest.mark.parametrize("report_wait_s", [2 * TIMEOUT_S, 0.3], ids=["in-flight", "owed"])
async def test_a_report_in_flight_or_owed_when_its_replica_dies_releases_the_version_within_a_lease(
    deployment: Deployment, pair: tuple[Replica, Replica], report_wait_s: float, request: pytest.FixtureRequest
) -> None:
    """``in-flight``: the report waits at the replica when it dies. ``owed``: the replica hung past the report's
    wait (``report_wait_s``), so ``report()`` returned and the client owes the report; then it dies."""
    victim, survivor = pair
    ident = identity(request)
    with anyio.fail_after(60):
        async with client(deployment, [victim, survivor], "trainer") as trainer, \
                client(deployment, [victim, survivor], "rollout", report_wait_s=report_wait_s) as rx:  # fmt: skip
            await rx.register_receiver(ident, "r1")
            await trainer.publish(manifest(1, 0, world=1, identity=ident))
            if report_wait_s > TIMEOUT_S:
                await in_flight_at_death(victim, rx, "report", rx.report(ident, "r1", 1))
            else:
                victim.stop()
                await rx.report(ident, "r1", 1)  # the replica hangs: report() gives up, the client owes it
                assert rx._upkeep.unsent, "the report was not owed"
                victim.kill()
            with anyio.fail_after(LEASE_S):  # within a lease of the commit
                await trainer.wait_released(ident, 1, None)


@pytest.mark.asyncio
@pytest.mark.parametrize("op", ["relay_join", "relay_leave"])
async def test_a_relay_join_or_leave_in_flight_when_its_replica_dies_lands_on_the_survivor(
    deployment: Deployment, pair: tuple[Replica, Replica], op: str, request: pytest.FixtureRequest
) -> None:
    victim, survivor = pair
    ident = identity(request)
    with anyio.fail_after(60):
        async with client(deployment, [victim, survivor], "trainer") as trainer, \
                client(deployment, [victim, survivor], "rollout") as rx, \
                client(deployment, [survivor], "rollout") as other:  # fmt: skip
            await rx.register_receiver(ident, "a")
            await trainer.publish(manifest(1, 0, world=1, identity=ident))
            if op == "relay_join":
                offer = _offer(ident, 1, "a")
                assert await in_flight_at_death(victim, rx, op, rx.relay_join(ident, 1, "a", layout=offer.layout,
                                                                              offer=offer)) is None
                assert await other.relayed(ident) == 1  # a relays version 1: the next reader reads it
                up = await other.relay_join(ident, 1, "b", layout=offer.layout)
                assert up is not None and up.receiver == "a"
            else:
                offer = _offer(ident, 1, "a")
                await rx.relay_join(ident, 1, "a", layout=offer.layout, offer=offer)
                await in_flight_at_death(victim, rx, op, rx.relay_leave(ident, "a"))
                assert await other.relayed(ident) is None


@pytest.mark.asyncio
async def test_a_heartbeat_in_flight_when_its_replica_dies_keeps_the_lease(
    deployment: Deployment, pair: tuple[Replica, Replica], request: pytest.FixtureRequest
) -> None:
    """A heartbeat in flight at the replica when it dies is answered by the survivor, and the client's lease (one
    etcd lease per client) is kept alive through it by the heartbeats that follow: two leases later it is the same
    lease, and the receiver it registered was never dropped and registered again."""
    victim, survivor = pair
    ident = identity(request)
    with anyio.fail_after(90):
        async with client(deployment, [victim, survivor], "rollout") as rx, \
                client(deployment, [survivor], "operator") as observer:  # fmt: skip
            await rx.register_receiver(ident, "r1")  # starts its heartbeats (every lease / 4)
            lease = deployment.owner_lease(rx.client_id)
            assert lease is not None
            other = rx._channel.channels[1]
            await in_flight_at_death(victim, rx, "heartbeat", rx._request("heartbeat", owner=rx.client_id))
            beats = other.sent["heartbeat"]

            async def two_leases_of_heartbeats() -> bool:
                return other.sent["heartbeat"] >= beats + 8

            await until(two_leases_of_heartbeats, 6 * LEASE_S, "eight heartbeats through the survivor")
            assert deployment.owner_lease(rx.client_id) == lease  # never expired: no new lease was granted
            assert await observer.acked(ident, 1) == (0, 1)


@pytest.mark.asyncio
async def test_a_wait_released_long_poll_at_a_replica_that_dies_returns_within_a_lease_of_the_report(
    deployment: Deployment, pair: tuple[Replica, Replica], request: pytest.FixtureRequest
) -> None:
    victim, survivor = pair
    ident = identity(request)
    with anyio.fail_after(60):
        async with client(deployment, [victim, survivor], "trainer") as trainer, \
                client(deployment, [survivor], "rollout") as rx:  # fmt: skip
            await rx.register_receiver(ident, "r1")
            await trainer.publish(manifest(1, 0, world=1, identity=ident))
            channel = trainer._channel.channels[0]
            waiting = asyncio.create_task(trainer.wait_released(ident, 1, None))

            async def polling() -> bool:
                return channel.in_flight["wait_released"] >= 1

            await until(polling, TIMEOUT_S, "the long poll is at the replica")
            victim.kill()
            await rx.report(ident, "r1", 1)
            with anyio.fail_after(LEASE_S):
                await waiting
            assert channel.lost["wait_released"] >= 1


@pytest.mark.asyncio
async def test_a_wait_complete_at_a_replica_that_dies_finds_the_version_published_through_the_survivor(
    deployment: Deployment, pair: tuple[Replica, Replica], request: pytest.FixtureRequest
) -> None:
    victim, survivor = pair
    ident = identity(request)
    with anyio.fail_after(60):
        async with client(deployment, [survivor], "trainer") as trainer, \
                client(deployment, [victim, survivor], "rollout") as rx:  # fmt: skip
            await rx.hello()
            channel, other = rx._channel.channels
            victim.stop()
            waiting = asyncio.create_task(rx.wait_complete(ident, 1, 60))

            async def asked() -> bool:
                return channel.in_flight["latest"] >= 1

            async def answered() -> bool:
                return other.sent["latest"] >= 1 and not other.in_flight["latest"]

            await until(asked, TIMEOUT_S, "the first query sent to the stopped replica")
            victim.kill()
            await until(answered, TIMEOUT_S, "the query moved to the survivor, which answered")
            await trainer.publish(manifest(1, 0, world=1, identity=ident))  # after the survivor said "none yet"
            with anyio.fail_after(LEASE_S):
                found = await waiting
            assert found.version == 1 and channel.lost["latest"] >= 1


@pytest.mark.asyncio
async def test_an_address_where_nobody_listens_costs_a_request_nothing(
    deployment: Deployment, pair: tuple[Replica, Replica], request: pytest.FixtureRequest
) -> None:
    """A replica address where nothing listens (a replica not started, or dead before the client first tried it)
    is left as soon as the connection is refused, not at the end of its share of a long deadline: the request
    was never sent (``Unsent``); the long poll after it goes to the replica that answers first."""
    _, survivor = pair
    ident = identity(request)
    nobody = f"tcp://127.0.0.1:{free_port()}"
    with anyio.fail_after(60):
        async with RegistryClient([nobody, survivor.address], security=deployment.keys.client_named("trainer"),
                                  request_timeout_s=60) as trainer:  # fmt: skip
            with anyio.fail_after(TIMEOUT_S):  # not the 30 s share of the first replica
                await trainer.publish(manifest(1, 0, world=1, identity=ident))
            assert trainer._channel.channels[0].up is False
            with anyio.fail_after(TIMEOUT_S):
                await trainer.wait_released(ident, 1, None)  # no receiver: released at once, by the survivor


def _model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.weight": torch.randn(256, 1024, generator=g) for i in range(8)}  # 8 MiB


@pytest.mark.asyncio
async def test_a_replica_killed_mid_refit_and_never_restarted_stalls_no_release(
    deployment: Deployment, pair: tuple[Replica, Replica], request: pytest.FixtureRequest
) -> None:
    """Issue 53: a trainer and a receiver (NIXL, relays on) given both replicas; the one they use is killed while
    the receiver pulls and never comes back. The refit commits bit-exactly, ``released(v)`` returns within a
    lease of the commit, and the next version commits and is released through the survivor alone."""
    victim, survivor = pair
    ident = identity(request)
    address = f"{victim.address},{survivor.address}"
    src = _model(0)
    dst = {n: torch.zeros_like(t) for n, t in src.items()}
    with anyio.fail_after(120):
        async with rf.Publisher(address, identity=ident, security=deployment.keys.client_named("trainer")) as pub, \
                rf.Receiver(dst, address, identity=ident, security=deployment.keys.client_named("rollout"),
                            mode="shadow", budget_bytes=1 << 20, serve_replicas=True) as rcv:  # fmt: skip
            for version in (1, 2, 3):
                for name, t in _model(version).items():
                    src[name].copy_(t)
                await pub.publish(version, src)
                refit = asyncio.create_task(rcv.refit(version, timeout=60))
                if version == 2:

                    async def pulling(refit: asyncio.Task[Any] = refit) -> bool:
                        return rcv.ledger.open is not None or refit.done()

                    await until(pulling, 30, "the refit of version 2 began")
                    victim.kill()
                result = await refit
                assert result.version == version and all(torch.equal(dst[n], src[n]) for n in src)
                with anyio.fail_after(LEASE_S):  # within a lease of the commit
                    await pub.released(version)
            assert not victim.alive
