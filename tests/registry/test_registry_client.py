"""RegistryClient against an in-process registry service: typed errors, deadlines, leases, filters, CURVE."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import anyio
import orjson
import pytest
import zmq
import zmq.asyncio

import refitflow as rf
from refitflow.cli.registry_cmd import keys_main
from refitflow.core.types import Manifest, ShardSpec, SourceAddress
from refitflow.core.wire import digests_to_dict, manifest_to_dict
from refitflow.registry.client.client import RegistryClient
from refitflow.registry.security import ClientSecurity, ServerSecurity
from tests._procs import ends_within

ID = rf.Identity(model="m")


def manifest(version: int, rank: int, *, world: int = 2, digest: str = "0" * 16, identity: rf.Identity = ID,
             metadata: dict[str, str] | None = None) -> Manifest:  # fmt: skip
    shard = ShardSpec(name="w", dtype="float32", global_shape=(4, 2), axis=0, start=2 * rank, stop=2 * rank + 2,
                      digest=digest, region=0)  # fmt: skip
    return Manifest(identity=identity, version=version, rank=rank, world_size=world, shards=(shard,),
                    source=SourceAddress(transport="loopback", agent=f"a{rank}"), metadata=metadata or {})  # fmt: skip


@pytest.mark.asyncio
async def test_refused_publications_raise_the_matching_typed_error() -> None:
    with anyio.fail_after(30):
        async with rf.Registry.serve("tcp://127.0.0.1:*") as server, RegistryClient(server.address) as client:
            await client.publish(manifest(1, 0))
            with pytest.raises(rf.VersionError, match="other content"):
                await client.publish(manifest(1, 0, digest="f" * 16))
            shard = ShardSpec(name="w", dtype="float32", global_shape=(4, 2), axis=0, start=1, stop=3,
                              digest="0" * 16, region=0)  # fmt: skip
            bad = Manifest(identity=ID, version=1, rank=1, world_size=2, shards=(shard,),  # overlaps rank 0's [0, 2)
                           source=SourceAddress(transport="loopback", agent="a1"))  # fmt: skip
            with pytest.raises(rf.ManifestError, match="overlaps") as info:
                await client.publish(bad)
            assert info.value.tensor == "w" and info.value.version == 1
            await client.publish(manifest(1, 1))
            assert (await client.latest(ID)) is not None


@pytest.mark.asyncio
async def test_unanswered_request_raises_timeout_and_late_reply_is_dropped() -> None:
    with anyio.fail_after(30):
        ctx = zmq.asyncio.Context()
        silent = ctx.socket(zmq.ROUTER)
        port = silent.bind_to_random_port("tcp://127.0.0.1")
        try:
            async with RegistryClient(f"tcp://127.0.0.1:{port}", request_timeout_s=0.3) as client:
                with pytest.raises(rf.RefitTimeoutError, match="did not answer"):
                    await client.latest(ID)
                peer, request = await silent.recv_multipart()
                late = b'{"v":1,"id":0,"ok":true,"result":null}'
                await silent.send_multipart([peer, late])  # the answer to the request that gave up
                answer = asyncio.create_task(client.versions(ID))
                peer, request = await silent.recv_multipart()
                await silent.send_multipart([peer, request.replace(b'"op"', b'"ok":true,"result":[5],"op"')])
                assert await answer == [5]
        finally:
            ctx.destroy(linger=0)


@pytest.mark.asyncio
async def test_concurrent_requests_share_one_client() -> None:
    with anyio.fail_after(30):
        async with rf.Registry.serve("tcp://127.0.0.1:*") as server, RegistryClient(server.address) as client:
            await client.publish(manifest(1, 0))
            await client.publish(manifest(1, 1))
            await client.register_receiver(ID, "r")
            waiter = asyncio.create_task(client.wait_released(ID, 1, 10))
            found = await asyncio.gather(*(client.latest(ID) for _ in range(50)))
            assert {p.version for p in found if p} == {1} and client.fetches == 1
            assert not waiter.done()
            await client.report(ID, "r", 1)
            await waiter


@pytest.mark.asyncio
async def test_wait_complete_wakes_on_announcement_and_filters() -> None:
    with anyio.fail_after(30):
        async with (
            rf.Registry.serve("tcp://127.0.0.1:*") as server,
            RegistryClient(server.address) as pub,
            RegistryClient(server.address, requery_s=60) as rx,  # only an announcement can wake it in time
        ):
            other = rf.Identity(model="m", compile_target="trt")
            waiting = asyncio.create_task(rx.wait_complete(ID, 1, 20, compile_targets=["trt"], metadata={"k": "v"}))
            await pub.publish(manifest(0, 0, identity=other))
            while rx.announcements == 0:  # until the subscription is up (ZMQ slow joiner)
                await pub.publish(manifest(0, 1, identity=other))  # completes version 0 (filtered out): announced
                await asyncio.sleep(0.05)
            await pub.publish(manifest(1, 0, identity=other))
            await pub.publish(manifest(1, 1, identity=other, metadata={"k": "v"}))  # rank 0 lacks k=v: filtered
            await pub.publish(manifest(2, 0, identity=other, metadata={"k": "v", "x": "y"}))
            await pub.publish(manifest(2, 1, identity=other, metadata={"k": "v"}))
            with anyio.fail_after(5):
                found = await waiting
            assert found.version == 2 and found.identity.compile_target == "trt"
            assert await rx.latest(ID) is None  # hf_raw itself was not allowed, and nothing was published there


@pytest.mark.asyncio
async def test_lease_expiry_and_restart_reannounce() -> None:
    with anyio.fail_after(30):
        async with rf.Registry.serve("tcp://127.0.0.1:*", lease_s=0.5) as server:
            address = server.address
            gone = RegistryClient(address, heartbeat_s=0.1)
            await gone.publish(manifest(1, 0))
            await gone.publish(manifest(1, 1))
            async with RegistryClient(address) as rx:
                assert (await rx.latest(ID)) is not None
                await gone.aclose()  # stops heartbeating, as a killed publisher would
                while await rx.latest(ID) is not None:  # noqa: ASYNC110 (withdrawals are not announced)
                    await asyncio.sleep(0.05)
        async with RegistryClient(address, heartbeat_s=0.1) as publisher:
            async with rf.Registry.serve(address, lease_s=5) as server:
                await publisher.publish(manifest(3, 0))
                await publisher.publish(manifest(3, 1))
            async with rf.Registry.serve(address, lease_s=5) as restarted, RegistryClient(address) as rx:
                found = await rx.wait_complete(ID, 3, 10)  # re-announced by the publisher's heartbeat task
                assert found.version == 3 and restarted.address == address


@pytest.mark.asyncio
async def test_curve_refuses_unknown_clients(tmp_path: Path) -> None:
    with anyio.fail_after(30):
        assert keys_main([str(tmp_path / "keys"), "--clients", "trainer"]) == 0
        assert keys_main([str(tmp_path / "rogue"), "--clients", "trainer"]) == 0
        keys = tmp_path / "keys"
        security = ServerSecurity(secret_key_file=keys / "server.key_secret", authorized_dir=keys / "authorized")
        allowed = ClientSecurity(secret_key_file=keys / "trainer.key_secret", server_public_file=keys / "server.key")
        rogue = ClientSecurity(secret_key_file=tmp_path / "rogue" / "trainer.key_secret",
                               server_public_file=keys / "server.key")  # fmt: skip
        async with rf.Registry.serve("tcp://127.0.0.1:*", security=security) as server:
            async with RegistryClient(server.address, security=allowed) as client:
                await client.publish(manifest(1, 0))
                await client.publish(manifest(1, 1))
                assert (await client.wait_complete(ID, 1, 5)).version == 1
            for sec in (rogue, None):
                async with RegistryClient(server.address, security=sec, request_timeout_s=10) as stranger:
                    with anyio.fail_after(5), pytest.raises(rf.AuthenticationError):  # not a timeout
                        await stranger.publish(manifest(2, 0))
                    with anyio.fail_after(5), pytest.raises(rf.AuthenticationError):
                        await stranger.latest(ID)
            assert await server.registry.versions(ID) == [1]


@pytest.mark.asyncio
async def test_a_vanished_receiver_stops_holding_the_release_back() -> None:
    with anyio.fail_after(30):
        async with (
            rf.Registry.serve("tcp://127.0.0.1:*", lease_s=0.5) as server,
            RegistryClient(server.address) as publisher,
        ):
            vanishing = RegistryClient(server.address, heartbeat_s=0.1)
            await vanishing.register_receiver(ID, "rx")
            await publisher.publish(manifest(1, 0))
            await publisher.publish(manifest(1, 1))
            assert not await publisher.is_released(ID, 1)
            await vanishing.aclose()  # no report, no unregister: as a killed receiver
            await publisher.wait_released(ID, 1, timeout=10)


@pytest.mark.asyncio
async def test_wait_complete_outlasts_a_registry_that_starts_late() -> None:
    with anyio.fail_after(30):
        async with rf.Registry.serve("tcp://127.0.0.1:*") as server:
            address = server.address  # a port known free; nothing listens there until below
        async with RegistryClient(address, request_timeout_s=0.3, requery_s=0.1) as rx:
            waiting = asyncio.create_task(rx.wait_complete(ID, 1, 20))
            await asyncio.sleep(0.5)  # long enough for the first requests to time out: the point of the test
            assert not waiting.done()
            async with rf.Registry.serve(address), RegistryClient(address) as pub:
                await pub.publish(manifest(1, 0))
                await pub.publish(manifest(1, 1))
                assert (await waiting).version == 1


@pytest.mark.asyncio
async def test_a_version_announced_before_its_digests_is_offered_early_only_to_who_asks() -> None:
    """Two-phase publication over the service: laid out (every rank announced, digests pending) is seen by
    an early reader at once; a plain reader, and the release bookkeeping, see the version once complete."""
    pending = [dataclasses.replace(manifest(1, r), revision="", shards=(dataclasses.replace(manifest(1, r).shards[0],
               digest=""),)) for r in (0, 1)]  # fmt: skip
    with anyio.fail_after(30):
        async with (
            rf.Registry.serve("tcp://127.0.0.1:*") as server,
            RegistryClient(server.address) as trainer,
            RegistryClient(server.address, requery_s=5.0) as reader,
        ):
            for m in pending:
                await trainer.publish(m)
            assert await reader.latest(ID) is None
            early = await reader.wait_complete(ID, 1, 5, early=True)
            assert early.pending and [m.rank for m in early.manifests] == [0, 1]
            with pytest.raises(rf.VersionError, match="another layout"):  # the digests of another layout
                await trainer.publish(dataclasses.replace(manifest(1, 0), shards=(dataclasses.replace(
                    manifest(1, 0).shards[0], region=9),)))  # fmt: skip
            async with anyio.create_task_group() as tg:
                got: list[rf.Publication] = []

                async def wait() -> None:
                    got.append(await reader.wait_complete(ID, 1, 5))  # woken by the announcement

                tg.start_soon(wait)
                await anyio.sleep(0.2)
                assert not got
                await trainer.publish(manifest(1, 0))
                await trainer.publish(pending[1])  # still pending: nothing completes
                await trainer.publish(manifest(1, 1))
            (complete,) = got
            assert not complete.pending and complete.revision != early.revision
            await trainer.publish(pending[0])  # a late retry of the announcement changes nothing
            assert (await reader.latest(ID, early=True)) == complete


def wide(version: int, *, pending: bool, tensors: int = 200) -> Manifest:
    """One rank of ``tensors`` shards, announced pending (the layout) or complete (its digests)."""
    shards = tuple(ShardSpec(name=f"layers.{i}.mlp.weight", dtype="bfloat16", global_shape=(64, 64), axis=None,
                             start=0, stop=64, digest="" if pending else f"{i + version:016x}", region=i)
                   for i in range(tensors))  # fmt: skip
    return Manifest(identity=ID, version=version, rank=0, world_size=1, shards=shards,
                    source=SourceAddress(transport="loopback", agent="a0"))  # fmt: skip


@pytest.mark.asyncio
async def test_the_digests_of_an_announced_layout_go_alone_and_a_registry_without_it_gets_the_whole() -> None:
    """Two-phase publication's second message carries the digests alone (the registry holds the layout); a
    registry that does not hold the announcement any more refuses them, and the client sends the whole manifest."""
    with anyio.fail_after(30):
        async with rf.Registry.serve("tcp://127.0.0.1:*") as server, RegistryClient(server.address) as trainer:
            sent: list[tuple[str, int]] = []
            request = trainer._request

            async def spy(op: str, **args: object) -> object:
                if op in ("publish", "complete"):
                    sent.append((op, len(orjson.dumps(args))))
                return await request(op, **args)

            trainer._request = spy  # type: ignore[method-assign]
            await trainer.publish(wide(1, pending=True))
            await trainer.publish(wide(1, pending=False))
            _, (op, digests) = sent
            whole = len(orjson.dumps(manifest_to_dict(wide(1, pending=False))))
            assert op == "complete" and digests < whole / 2  # the names, shapes and regions went once, with the layout
            got = await trainer.latest(ID)
            assert got is not None and got.manifests == (wide(1, pending=False),)

            await trainer.publish(wide(2, pending=True))
            server.registry.withdraw(ID, 2, 0)  # e.g. its lease ran out meanwhile
            sent.clear()
            await trainer.publish(wide(2, pending=False))
            assert [op for op, _ in sent] == ["complete", "publish"]
            got = await trainer.latest(ID)
            assert got is not None and got.manifests == (wide(2, pending=False),)

            await trainer.publish(wide(3, pending=True))
            whole = digests_to_dict(wide(3, pending=False))
            short = {**whole, "digests": {**whole["digests"], "count": 199}}
            bad = dict(whole, digests={**whole["digests"], "each": {**whole["digests"]["each"],
                                                                     "digest": ["0" * 15] * 200}})  # fmt: skip
            for digests in (short, bad, {**whole, "revision": "0" * 32}):
                with pytest.raises(rf.ManifestError):
                    await request("complete", identity={"model": "m"}, version=3, rank=0, owner=trainer.client_id,
                                  digests=digests)  # fmt: skip
            assert (await trainer.latest(ID, early=True)).pending  # type: ignore[union-attr]
            await trainer.publish(wide(3, pending=False))
            assert (await trainer.latest(ID)).version == 3  # type: ignore[union-attr]


@pytest.mark.parametrize("address", ["tcp://not a host:7100", "tcp://-:7100", "ipc:///tmp/" + "x" * 200])
def test_an_address_zmq_refuses_is_a_config_error_and_the_client_closes(address: str) -> None:
    """Scheme and port are right, so the client is made; the first request says what is wrong and aclose()
    returns (a socket left open made the context's term() wait forever). In a thread of its own, with
    its own loop, so a hang fails the test instead of hanging it."""
    outcome: list[BaseException | str] = []

    async def use() -> None:
        client = RegistryClient(address, request_timeout_s=1)
        try:
            with pytest.raises(rf.ConfigError, match="cannot connect to the registry") as caught:
                await client.hello()
            outcome.append(caught.value)
        finally:
            await client.aclose()
        outcome.append("closed")

    assert ends_within(lambda: asyncio.run(use()), 10) is None
    assert len(outcome) == 2 and isinstance(outcome[0], rf.ConfigError) and outcome[1] == "closed", outcome
    assert address in str(outcome[0])
