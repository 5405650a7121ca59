"""Keys per role: what ``refitflow keys`` makes (a trainer, a rollout and an operator pair, the allow-list by
role), what the registry lets each key do (a rollout key cannot publish: ``RoleError``), and a rank's claim held
by the key that took it — another key sending the same owner id cannot take it over, after a registry restart
too (in memory: once the trainer re-announced; in etcd: the claim outlives the replicas). A folder made before
roles (one ``client`` pair in ``authorized/`` itself) keeps working for every role."""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

import refitflow as rf
from refitflow.core.fanout import RelayOffer
from refitflow.registry.client.client import RegistryClient
from refitflow.registry.service.etcd.store import EtcdStore
from tests.faults._util import free_address, until
from tests.registry._etcd import Cluster, loopback
from tests.registry.test_registry_client import ID, manifest

LEASE_S = 2.0  # a forger's publish is asked again for a lease before its refusal is raised


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    cluster = loopback(tmp_path_factory.mktemp("etcd"))
    try:
        yield cluster
    finally:
        cluster.close()


@pytest.fixture
def keys(tmp_path: Path) -> rf.DeploymentKeys:
    return rf.DeploymentKeys.create(tmp_path / "keys", ("trainer", "rollout", "operator", "trainer-b:trainer"))


@contextlib.asynccontextmanager
async def registry(keys: rf.DeploymentKeys, address: str, store: str, etcd_url: str = "", ns: str = ""
                   ) -> AsyncIterator[Any]:  # fmt: skip
    """A registry at ``address`` with CURVE (``store``: memory, or a replica of the etcd namespace ``ns``)."""
    async with contextlib.AsyncExitStack() as stack:
        state = None
        if store == "etcd":
            state = await stack.enter_async_context(EtcdStore.open(etcd_url, namespace=ns, lease_s=LEASE_S))
        yield await stack.enter_async_context(rf.Registry.serve(address, registry=state, lease_s=LEASE_S,
                                                                security=keys.server))  # fmt: skip


def _offer(rid: str) -> RelayOffer:
    return RelayOffer(identity=ID, version=1, receiver=rid, source=rf.SourceAddress(transport="loopback", agent=rid),
                      status=0, params=(), held=())  # fmt: skip


@pytest.mark.asyncio
async def test_each_role_may_do_its_part_and_a_rollout_keys_publish_is_refused(keys: rf.DeploymentKeys) -> None:
    with anyio.fail_after(60):
        async with registry(keys, "tcp://127.0.0.1:*", "memory") as server, \
                RegistryClient(server.address, security=keys.pair("trainer")) as trainer, \
                RegistryClient(server.address, security=keys.pair("rollout")) as rollout, \
                RegistryClient(server.address, security=keys.pair("operator")) as operator:  # fmt: skip
            with pytest.raises(rf.RoleError, match=r"rollout\.key: rollout\) may not publish: that takes a trainer"):
                await rollout.publish(manifest(1, 0, world=1))
            assert await operator.versions(ID) == []  # nothing published by it
            with pytest.raises(rf.RoleError, match="may not publish"):
                await operator.publish(manifest(1, 0, world=1))
            await trainer.publish(manifest(1, 0, world=1))
            with pytest.raises(rf.RoleError, match=r"trainer\) may not register_receiver: that takes a rollout"):
                await trainer.register_receiver(ID, "r1")
            await rollout.register_receiver(ID, "r1")  # an inference rank's part: register, relay, report
            assert await rollout.relay_join(ID, 1, "r1", layout="L", offer=_offer("r1")) is None
            await rollout.report(ID, "r1", 1)
            assert await trainer.acked(ID, 1) == (1, 1) and await operator.relayed(ID) == 1  # every role reads
            with pytest.raises(rf.RoleError, match="may not report"):
                await operator._request("report", identity={"model": ID.model}, receiver_id="r1", version=1)
            await operator.unregister_receiver(ID, "r1")  # evicting a receiver that holds releases back
            assert await trainer.acked(ID, 1) == (0, 0)


@pytest.mark.asyncio
async def test_a_folder_made_before_roles_keeps_working_for_every_role(tmp_path: Path,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    old = rf.DeploymentKeys.create(tmp_path / "old", ("client",))  # one pair, in authorized/ itself
    assert (old.folder / "authorized" / "client.key").is_file()
    assert old.pair("trainer") == old.pair("rollout") == old.client  # no role pair: the single one
    with anyio.fail_after(60), caplog.at_level(logging.WARNING):
        async with registry(old, "tcp://127.0.0.1:*", "memory") as server, \
                RegistryClient(server.address, security=old.pair("trainer")) as trainer, \
                RegistryClient(server.address, security=old.pair("rollout")) as rollout:  # fmt: skip
            await trainer.publish(manifest(1, 0, world=1))
            await rollout.register_receiver(ID, "r1")
            await rollout.report(ID, "r1", 1)
            assert await trainer.acked(ID, 1) == (1, 1)
    assert "client.key hold every role" in caplog.text
    keys = rf.DeploymentKeys.create(old.folder, ("trainer", "rollout", "operator"), replace=False)  # roles added
    assert keys.pair("rollout").secret_key_file.name == "rollout.key_secret" and old.client.secret_key_file.exists()
    with pytest.raises(rf.ConfigError, match="say which"):
        rf.DeploymentKeys.create(tmp_path / "new").client  # noqa: B018 (per-role folder: a role must be named)


@pytest.mark.asyncio
@pytest.mark.parametrize("store", ["memory", "etcd"])
async def test_a_claim_is_held_by_its_key_and_no_other_key_takes_it_over_after_a_restart(
    keys: rf.DeploymentKeys, store: str, request: pytest.FixtureRequest
) -> None:
    """A second trainer key sends the very owner id of the trainer that publishes rank 0 (a forger that learnt
    it): refused, before the registry restarts and after (in memory: once the trainer re-announced; in etcd the
    claim lives on, in etcd, through the replicas' restart). Before, the owner id alone held the claim."""
    url, ns = "", uuid.uuid4().hex[:10]
    if store == "etcd":
        url = request.getfixturevalue("etcd").url
    address = free_address()
    with anyio.fail_after(90):
        async with contextlib.AsyncExitStack() as stack:
            first = contextlib.AsyncExitStack()
            await first.enter_async_context(registry(keys, address, store, url, ns))
            trainer = await stack.enter_async_context(RegistryClient(address, security=keys.pair("trainer"),
                                                                     client_id="trainer-0", heartbeat_s=0.2))
            forger = await stack.enter_async_context(RegistryClient(address, security=keys.pair("trainer-b"),
                                                                    client_id="trainer-0", request_timeout_s=2))
            reader = await stack.enter_async_context(RegistryClient(address, security=keys.pair("operator")))
            await trainer.publish(manifest(1, 0))
            with pytest.raises(rf.VersionError, match="published by another client"):
                await forger.publish(manifest(2, 0))
            await first.aclose()  # the registry restarts (every replica, for etcd)
            await stack.enter_async_context(registry(keys, address, store, url, ns))

            async def offered() -> bool:  # the trainer is back: re-announced (memory), or still held (etcd)
                with contextlib.suppress(rf.RefitError):
                    return await reader.versions(ID) == [1]
                return False

            await until(offered, 30, "version 1 offered after the restart")
            with pytest.raises(rf.VersionError, match="published by another client"):
                await forger.publish(manifest(2, 0))
            await trainer.publish(manifest(2, 0))  # the key that holds the claim publishes on
            assert await reader.versions(ID) == [1, 2]
