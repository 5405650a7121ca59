"""The registry's state in a real etcd (one member on loopback): two replicas agree, writes are
compare-and-set, leases live in etcd, heartbeats rewrite nothing, large manifests go in chunks, released
versions leave etcd, and a client fails over between replicas within its deadline."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

import refitflow as rf
from refitflow.core.records import RankLayout
from refitflow.core.types import Manifest, ShardSpec, SourceAddress
from refitflow.core.wire import manifest_to_dict
from refitflow.registry.client.client import RegistryClient
from refitflow.registry.service.etcd.keys import CHUNK_BYTES, Keys
from refitflow.registry.service.etcd.store import EtcdStore
from tests.faults._util import free_address, until
from tests.registry._etcd import Cluster, loopback
from tests.registry.test_registry_client import ID, manifest


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Cluster]:
    cluster = loopback(tmp_path_factory.mktemp("etcd"))
    try:
        yield cluster  # type: ignore[misc]
    finally:
        cluster.close()


@contextlib.asynccontextmanager
async def replicas(url: str, n: int = 2, *, lease_s: float = 10.0) -> AsyncIterator[list[Any]]:
    ns = uuid.uuid4().hex[:10]
    async with contextlib.AsyncExitStack() as stack:
        servers = []
        for _ in range(n):
            store = await stack.enter_async_context(EtcdStore.open(url, namespace=ns, lease_s=lease_s))
            servers.append(await stack.enter_async_context(rf.Registry.serve("tcp://127.0.0.1:*", registry=store)))
        yield servers


def big_manifest(version: int, tensors: int) -> Manifest:
    shards = tuple(ShardSpec(name=f"layers.{i}.weight", dtype="bfloat16", global_shape=(64, 64), axis=0, start=0,
                             stop=64, digest=f"{i:016x}", region=i) for i in range(tensors))  # fmt: skip
    return Manifest(identity=ID, version=version, rank=0, world_size=1, shards=shards,
                    source=SourceAddress(transport="loopback", agent="big"))  # fmt: skip


@pytest.mark.asyncio
async def test_two_replicas_agree_and_a_version_is_never_published_twice(etcd: Cluster) -> None:
    with anyio.fail_after(60):
        async with replicas(etcd.url) as (a, b), RegistryClient(a.address) as ca, RegistryClient(b.address) as cb:
            assert a.incarnation == b.incarnation  # one store: moving between replicas is no restart
            waiting = asyncio.create_task(cb.wait_complete(ID, 1, 10))  # woken by b's watch, not b's own publish
            await asyncio.gather(ca.publish(manifest(1, 0)), cb.publish(manifest(1, 1)))  # two ranks, two replicas
            pub = await waiting
            assert pub.version == 1 and [m.rank for m in pub.manifests] == [0, 1]
            assert cb.announcements >= 1
            with pytest.raises(rf.VersionError, match="other content"):
                await ca.publish(manifest(1, 0, digest="f" * 16))  # rank 0 again, other bytes
            with pytest.raises(rf.VersionError, match="published by another client"):  # a's rank, by another client
                await cb._request("publish", manifest=manifest_to_dict(manifest(3, 0)), owner=cb.client_id)
            with pytest.raises(rf.ManifestError, match="overlaps"):
                bad = manifest(2, 1)
                shard = ShardSpec(name="w", dtype="float32", global_shape=(4, 2), axis=0, start=1, stop=3,
                                  digest="0" * 16, region=0)  # fmt: skip
                await ca.publish(manifest(2, 0))
                await cb.publish(Manifest(identity=ID, version=2, rank=1, world_size=2, shards=(shard,),
                                          source=bad.source))  # fmt: skip
            assert await ca.versions(ID) == await cb.versions(ID) == [1, 2]


@pytest.mark.asyncio
async def test_concurrent_publishes_through_both_replicas_lose_nothing(etcd: Cluster) -> None:
    """Compare-and-set on the version's key: 16 versions × 2 ranks, each rank through another replica, all at
    once; every version complete with both ranks' manifests, on both replicas."""
    with anyio.fail_after(90):
        async with replicas(etcd.url) as (a, b), RegistryClient(a.address) as ca, RegistryClient(b.address) as cb:
            await ca.register_receiver(ID, "holder")  # never reports: every version is kept
            await asyncio.gather(*(c.publish(manifest(v, r)) for v in range(1, 17)
                                   for r, c in ((0, ca), (1, cb))))  # fmt: skip
            for server in (a, b):
                store = server.registry
                assert await store.versions(ID) == list(range(1, 17))
                held = store.mirror._peek(ID)
                assert held.complete == list(range(1, 17)), server.address
                assert all(sorted(held.versions[v]) == [0, 1] for v in range(1, 17))


@pytest.mark.asyncio
async def test_leases_live_in_etcd_and_heartbeats_rewrite_no_manifest(etcd: Cluster) -> None:
    with anyio.fail_after(120):
        async with replicas(etcd.url, lease_s=3.0) as (a, b):
            store: EtcdStore = a.registry  # type: ignore[assignment]
            keys = store.keys
            client = RegistryClient(a.address, heartbeat_s=0.5)
            await client.publish(manifest(1, 0, world=1))
            key = keys.manifest(ID, 1, 0)
            _, before = await store.etcd.get_prefix(key)
            await anyio.sleep(2.0)  # four heartbeats
            _, after = await store.etcd.get_prefix(key)
            assert [kv.mod_revision for kv in after] == [kv.mod_revision for kv in before]  # not rewritten
            assert before[0].lease != 0 and before[0].lease == store._owners[client.client_id]
            assert (await b.registry.latest(ID)) is not None
            await client.aclose()  # no more heartbeats: etcd expires the lease, every replica drops the version

            async def dropped() -> bool:
                return (await b.registry.latest(ID)) is None and (await a.registry.latest(ID)) is None

            await until(dropped, 30, "every replica drops the version of an expired lease")

            async def cleaned() -> bool:  # the version key, with no manifest left, is cleaned up too
                return not (await store.etcd.get_prefix(keys.version(ID, 1)))[1]

            await until(cleaned, 30, "the version's keys leave etcd")


@pytest.mark.asyncio
async def test_a_large_manifest_is_written_once_in_chunks_below_etcds_request_limit(etcd: Cluster) -> None:
    with anyio.fail_after(120):
        async with replicas(etcd.url) as (a, b), RegistryClient(a.address) as ca, RegistryClient(b.address) as cb:
            big = big_manifest(1, 40_000)  # ≈ 1.7 MB (names, digests and regions differ): a head and 2 chunks
            await ca.publish(big)
            got = await cb.wait_complete(ID, 1, 90)
            assert got.manifests[0] == big
            store: EtcdStore = a.registry  # type: ignore[assignment]
            # the rank's layout (names, shapes, regions) once, as a head and its chunks; the version a small record
            _, kvs = await store.etcd.get_prefix(store.keys.layout(RankLayout.id_of(big)))
            assert len(kvs) > 2 and all(len(kv.value) <= CHUNK_BYTES for kv in kvs)  # a head and its chunks
            _, kvs = await store.etcd.get_prefix(store.keys.manifest(ID, 1, 0))
            assert len(kvs) == 1 and len(kvs[0].value) < 40_000 * 8 + 1000  # the revision and raw digests alone


@pytest.mark.asyncio
async def test_released_versions_leave_etcd_and_receivers_and_relays_are_shared(etcd: Cluster) -> None:
    with anyio.fail_after(120):
        async with replicas(etcd.url, lease_s=2.0) as (a, b), RegistryClient(a.address) as ca, \
                RegistryClient(b.address) as cb:  # fmt: skip
            await cb.register_receiver(ID, "r1")
            await ca.publish(manifest(1, 0, world=1))
            assert await ca.acked(ID, 1) == (0, 1)  # registered through b, seen through a
            assert await ca.relay_join(ID, 1, "r1") is None  # a reader with no upstream: the trainer
            await cb.report(ID, "r1", 1)
            await ca.publish(manifest(2, 0, world=1))
            await ca.wait_released(ID, 1, 10)
            store: EtcdStore = b.registry  # type: ignore[assignment]

            async def cleaned() -> bool:  # released and superseded: deleted from etcd by a replica's clean-up
                return not (await store.etcd.get_prefix(store.keys.version(ID, 1)))[1]

            await until(cleaned, 30, "the released version's keys leave etcd")
            assert await cb.versions(ID) == [2]


@pytest.mark.asyncio
async def test_a_client_fails_over_to_the_other_replica_within_its_deadline(etcd: Cluster) -> None:
    with anyio.fail_after(60):
        ns = uuid.uuid4().hex[:10]
        async with contextlib.AsyncExitStack() as stack:
            store_b = await stack.enter_async_context(EtcdStore.open(etcd.url, namespace=ns))
            b = await stack.enter_async_context(rf.Registry.serve("tcp://127.0.0.1:*", registry=store_b))
            a_stack = contextlib.AsyncExitStack()
            store_a = await a_stack.enter_async_context(EtcdStore.open(etcd.url, namespace=ns))
            a = await a_stack.enter_async_context(rf.Registry.serve("tcp://127.0.0.1:*", registry=store_a))
            # a deadline a loaded machine's etcd write fits in: half of it for the dead replica, half for b
            client = await stack.enter_async_context(RegistryClient(f"{a.address},{b.address}", request_timeout_s=8.0))
            await client.publish(manifest(1, 0))
            await a_stack.aclose()  # replica a is gone
            loop = asyncio.get_running_loop()
            started = loop.time()
            await client.publish(manifest(1, 1))  # within one request's deadline, through b
            assert loop.time() - started < 8.0 + 1.0
            assert (await client.latest(ID)) is not None and (await store_b.latest(ID)) is not None
            with pytest.raises(rf.ConfigError):
                RegistryClient("tcp://127.0.0.1:1,nonsense")


@pytest.mark.asyncio
async def test_a_publish_through_a_replica_whose_watch_lags_waits_for_it_instead_of_losing_every_round(
    etcd: Cluster,
) -> None:
    """A rank's claim ends in etcd (its lease expired; deleted here directly) while replica a's watch is held
    back, as when the member it watches is cut off from the rest (tests/hosts cuts one for real): a's mirror
    still shows the claim, so its compare-and-set fails. A deletion leaves no key whose revision says so; the
    next round compares with what etcd answered the lost one, and the publish lands (answered once the watch
    moves on). Before, every round compared with the stale mirror, and all 16 were lost in milliseconds (CI saw
    it, an etcd member cut off)."""
    with anyio.fail_after(60):
        ns = uuid.uuid4().hex[:10]
        async with EtcdStore.open(etcd.url, namespace=ns) as a:
            await a.publish(manifest(1, 0, world=1), owner="trainer")  # claims rank 0 for "trainer"
            supervisor = a._tasks[0]  # the watch held back: its supervisor and the watch itself stopped
            supervisor.cancel()
            assert a._watch is not None
            a._watch.cancel()
            await asyncio.gather(supervisor, a._watch, return_exceptions=True)
            _, claims = await a.etcd.get_prefix(a.keys.claim(ID, 0))
            assert claims
            await a.etcd.delete_prefix(a.keys.claim(ID, 0))

            async def resume() -> None:
                await anyio.sleep(1.0)
                a._tasks[0] = asyncio.create_task(a._supervise())

            async with anyio.create_task_group() as tg:
                tg.start_soon(resume)
                await a.publish(manifest(2, 0, world=1), owner="trainer")
            assert (await a.latest(ID)).version == 2  # type: ignore[union-attr]
            _, claims = await a.etcd.get_prefix(a.keys.claim(ID, 0))
            assert len(claims) == 1  # taken again, by the same owner


@pytest.mark.asyncio
async def test_the_janitor_never_judges_a_version_whose_manifest_is_still_being_applied(
    etcd: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The watch applies a version's key, then decodes its manifest (a large one in a worker thread); the
    janitor, running meanwhile, saw a version key with no version in the mirror and deleted the version just
    published. The decode is slowed here (0.5 s) to widen that window; the janitor runs every 0.2 s."""
    with anyio.fail_after(60):
        ns = uuid.uuid4().hex[:10]
        async with EtcdStore.open(etcd.url, namespace=ns, lease_s=0.8) as a:
            decode = a._decode

            async def slow(d: dict[str, Any], rows: int, fn: Any) -> Any:
                await anyio.sleep(0.5)
                return await decode(d, rows, fn)

            monkeypatch.setattr(a, "_decode", slow)
            await a.publish(big_manifest(1, 300))
            await anyio.sleep(1.5)  # several of the janitor's rounds
            assert (await a.etcd.get_prefix(a.keys.version(ID, 1)))[1]
            assert (await a.latest(ID)).version == 1  # type: ignore[union-attr]


def test_keys_refuse_a_namespace_with_a_slash(tmp_path: Path) -> None:
    with pytest.raises(rf.ManifestError):
        Keys("a/b")


def test_the_cli_refuses_a_store_it_cannot_use(capsys: pytest.CaptureFixture[str]) -> None:
    from refitflow.cli.registry_cmd import registry_main

    for bad in ("etcd://", "etcd://host-without-port", "redis://h:1"):
        with pytest.raises(SystemExit) as info:
            registry_main(["--store", bad])
        assert info.value.code == 2
        assert "--store" in capsys.readouterr().err


@pytest.mark.asyncio
async def test_a_layout_is_written_once_and_a_receiver_on_another_replica_reads_its_part(etcd: Cluster) -> None:
    from tests.registry.test_partial import ID as PID
    from tests.registry.test_partial import manifest as tiled
    from tests.registry.test_partial import order_of

    with anyio.fail_after(120):
        async with replicas(etcd.url) as (a, b), RegistryClient(a.address) as ca, RegistryClient(b.address) as cb:
            store: EtcdStore = a.registry  # type: ignore[assignment]
            for version in (1, 2):
                for rank in (0, 1):
                    await ca.publish(tiled(version, rank))
                outline = await cb.wait_outline(PID, version, 30)
                whole = await cb.wait_complete(PID, version, 30)
                order, count = order_of(whole, [(1, 2), (0, 5)])
                want = [s.digest_array() for s in (whole.manifests[1].shards[2], whole.manifests[0].shards[5])]
                assert (await outline.digests(order, count) == np.concatenate(want)).all()
            _, layouts = await store.etcd.get_prefix(store.keys.root + b"l/")
            assert len(layouts) == 2  # each rank's layout once, whatever the versions



@pytest.mark.asyncio
async def test_relays_join_by_geometry_through_either_replica(etcd: Cluster) -> None:
    from tests.registry.test_partial import _offer

    with anyio.fail_after(120):
        async with replicas(etcd.url) as (a, b), RegistryClient(a.address) as ca, RegistryClient(b.address) as cb:
            await ca.register_receiver(ID, "r1")  # every version stays held
            await ca.publish(manifest(1, 0, world=1))
            first = dataclasses.replace(_offer(1, "r1"), identity=ID, held=(), layout="")
            second = dataclasses.replace(_offer(1, "r2"), identity=ID, held=(), layout="")
            sent: list[Any] = []
            request = cb._request

            async def spy(op: str, **args: Any) -> Any:
                if op == "relay_join":
                    sent.append(args["offer"])
                return await request(op, **args)

            cb._request = spy  # type: ignore[method-assign]
            assert await ca.relay_join(ID, 1, "r1", offer=first) is None  # whole, once: etcd carries its geometry
            assert await cb.relay_join(ID, 1, "r2", offer=second) == first  # through b, compact, its upstream r1
            assert ["params" in o for o in sent] == [False]  # b's mirror held the geometry: no second whole offer
            # a shadow relay that swaps storages keeps offering the version it serves while it refits the next
            await ca.publish(manifest(2, 0, world=1))
            await cb.relay_leave(ID, "r2")
            assert await ca.relay_join(ID, 2, "r1", offer=dataclasses.replace(first, version=2), keep=1) is None
            assert await cb.relay_join(ID, 1, "r3") == first  # a laggard still reads version 1 from r1
            assert await ca.relay_join(ID, 2, "r1", offer=dataclasses.replace(first, version=2)) is None
            assert await cb.relay_join(ID, 1, "r4") is None  # joined again without keep: r1 left version 1


@pytest.mark.asyncio
async def test_a_replica_restarted_where_its_announcement_port_is_taken_is_heard_again(etcd: Cluster) -> None:
    """A replica restarted over the same etcd store keeps its incarnation (no restart to its clients) but announces
    on another port when its usual one (the next after its address) is taken: its clients learn where from its
    answers and hear its announcements again."""
    ns, address = uuid.uuid4().hex[:10], free_address()
    with anyio.fail_after(60):
        async with RegistryClient(address) as client:
            async with EtcdStore.open(etcd.url, namespace=ns) as store, rf.Registry.serve(address, registry=store) as a:
                await client.publish(manifest(1, 0, world=1))
                await client.wait_complete(ID, 1, 10)  # subscribed where the replica announces
                first, incarnation = a.pub_address, a.incarnation
            with socket.socket() as squatter:  # another process took the port meanwhile
                squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # the old connections' TIME_WAIT
                squatter.bind(("127.0.0.1", int(first.rsplit(":", 1)[1])))
                squatter.listen()
                async with (
                    EtcdStore.open(etcd.url, namespace=ns) as store,
                    rf.Registry.serve(address, registry=store) as b,
                ):
                    assert b.incarnation == incarnation and b.pub_address != first
                    await client.publish(manifest(2, 0, world=1))
                    await client.wait_complete(ID, 2, 10)
                    heard = client.announcements
                    await client.publish(manifest(3, 0, world=1))

                    async def announced() -> bool:
                        return client.announcements > heard

                    await until(announced, 10, "an announcement of the restarted replica")
