"""Registry input that used to poison or stall the service: refused with a typed error, everyone else served.

Requests go as raw frames (a DEALER of the test's own) where the client library would refuse them
itself; the registry runs in this process unless the point is that its event loop is not stalled.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import orjson
import pytest
import torch
import zmq
import zmq.asyncio

import refitflow as rf
from refitflow.core.wire import PROTOCOL_VERSION
from refitflow.registry.client.client import RegistryClient
from refitflow.registry.service import checks
from refitflow.registry.service.store import RegistryStore
from tests.faults._util import free_address, spawn_registry
from tests.registry._procs import stop
from tests.registry.test_registry_client import ID, manifest
from tests.registry.test_registry_hostile import NO_TILES
from tests.registry.test_registry_hostile import manifest as manifest_dict
from tests.registry.test_registry_leases import Clock


class Raw:
    """A DEALER speaking the protocol by hand: any frame, any field."""

    def __init__(self, sock: zmq.asyncio.Socket) -> None:
        self.sock = sock

    async def ask(self, *frames: bytes) -> dict[str, Any]:
        await self.sock.send_multipart(list(frames))
        with anyio.fail_after(10):
            return dict(orjson.loads(await self.sock.recv()))

    async def request(self, op: str, v: Any = PROTOCOL_VERSION, **args: Any) -> dict[str, Any]:
        return await self.ask(orjson.dumps({"v": v, "id": 7, "op": op, **args}))


@asynccontextmanager
async def raw(address: str) -> AsyncIterator[Raw]:
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        yield Raw(sock)
    finally:
        ctx.destroy(linger=0)


def refused(reply: dict[str, Any], error: str, words: str = "") -> bool:
    return reply["ok"] is False and reply["error"] == error and words in reply["message"]


@pytest.mark.usefixtures("store")
@pytest.mark.asyncio
async def test_an_empty_manifest_at_a_huge_version_is_refused_and_receivers_keep_refitting() -> None:
    identity = rf.Identity(model="hostile")
    with anyio.fail_after(60):
        async with rf.Registry.serve("tcp://127.0.0.1:*") as server, raw(server.address) as attacker:
            poison = manifest_dict(0, [], version=2**62, world_size=1)
            assert refused(
                await attacker.request("publish", manifest=poison, owner="attacker"),
                "ManifestError",
                "at least one shard",
            )
            weights, model = {"w": torch.ones(4, 3)}, {"w": torch.zeros(4, 3)}
            async with (
                rf.Publisher(server.address, identity=identity) as pub,
                rf.Receiver(model, server.address, identity=identity) as rcv,
            ):
                for version in (1, 2):
                    weights["w"].add_(1)
                    await pub.publish(version, weights)
                    assert (await rcv.refit(timeout=20)).version == version
                    assert torch.equal(model["w"], weights["w"])


@pytest.mark.parametrize(
    ("over", "words"),
    [
        ({"shards": [["w", "float32", [10**9, 10**9], 0, 0, 4, "0" * 16, 0, 0, *NO_TILES]]}, "elements"),
        ({"shards": [["w", "float32", [1] * 9, None, 0, 1, "0" * 16, 0, 0, *NO_TILES]]}, "dimensions"),
        ({"world_size": 10**12}, "world size"),
        ({"version": 2**63}, "version"),
        ({"shards": [["w", "float32", [8, 3], 0, 0, 4, "0" * 16, 2**63, 0, *NO_TILES]]}, "region"),
    ],
)
@pytest.mark.usefixtures("store")
@pytest.mark.asyncio
async def test_absurd_sizes_are_refused(over: dict[str, Any], words: str) -> None:
    with anyio.fail_after(30):
        async with rf.Registry.serve("tcp://127.0.0.1:*") as server, raw(server.address) as client:
            reply = await client.request("publish", manifest=manifest_dict(0, **over), owner="c")
            assert refused(reply, "ManifestError", words), reply
            assert (await client.request("hello"))["ok"]


@pytest.mark.parametrize("name", ["a\x00b", "layers/0", "layers\\0", "../w", ".hidden", "-x", "w" * 1025, "wé", ""])
def test_tensor_names_with_nul_separators_or_odd_characters_are_refused(name: str) -> None:
    with pytest.raises(rf.ManifestError):
        rf.ShardSpec(name=name, dtype="float32", global_shape=(2,), axis=None, start=0, stop=2, digest="0" * 16,
                     region=0)  # fmt: skip


@pytest.mark.parametrize("name", ["model.layers.0.mlp.down_proj.weight", "_extra_state", "a-b:c.0", "w" * 1024])
def test_tensor_names_of_real_models_are_accepted(name: str) -> None:
    spec = rf.ShardSpec(name=name, dtype="float32", global_shape=(2,), axis=None, start=0, stop=2, digest="0" * 16,
                        region=0)  # fmt: skip
    assert spec.name == name


@pytest.mark.usefixtures("store")
@pytest.mark.parametrize("v", [True, 1.0, "1", None])
@pytest.mark.asyncio
async def test_a_protocol_version_must_be_the_integer(v: Any) -> None:
    with anyio.fail_after(30):
        async with rf.Registry.serve("tcp://127.0.0.1:*") as server, raw(server.address) as client:
            assert refused(await client.request("hello", v=v), "ManifestError", "protocol version")


@pytest.mark.asyncio
async def test_a_version_far_ahead_of_the_newest_complete_one_is_refused() -> None:
    store = RegistryStore(limits=rf.RegistryLimits(max_version_ahead=100))
    await store.publish(manifest(5, 0, world=1))
    with pytest.raises(rf.VersionError, match="more than 100 versions above"):
        await store.publish(manifest(106, 0, world=1))
    await store.publish(manifest(105, 0, world=1))
    await store.publish(manifest(205, 0, world=2))  # ahead of 105 by 100: allowed, incomplete
    await store.publish(manifest(205, 1, world=2))  # a rank of a version already held is never refused for it
    unbounded = RegistryStore(limits=rf.RegistryLimits(max_version_ahead=None))
    await unbounded.publish(manifest(1, 0, world=1))
    await unbounded.publish(manifest(2**62, 0, world=1))
    assert await store.versions(ID) == [205] and await unbounded.versions(ID) == [2**62]


@pytest.mark.asyncio
async def test_unowned_incomplete_versions_expire_and_owned_or_complete_ones_stay() -> None:
    clock = Clock()
    store = RegistryStore(lease_s=10, clock=clock, limits=rf.RegistryLimits(incomplete_ttl_s=30))
    await store.publish(manifest(1, 0, world=1))  # complete, no owner: kept
    await store.publish(manifest(2, 0))  # incomplete, no owner: expires
    await store.publish(manifest(3, 0), owner="trainer")  # incomplete, owned by a live client: kept
    for now in (10.0, 20.0, 31.0):
        clock.now = now
        assert await store.heartbeat("trainer")
        assert store.expire() == []
    assert await store.versions(ID) == [1, 3]


@pytest.mark.usefixtures("store")
@pytest.mark.asyncio
async def test_too_many_shards_are_refused_before_any_is_built() -> None:
    shards = [[f"w{i}", "float32", [2], None, 0, 2, "0" * 16, i, 0, *NO_TILES] for i in range(1001)]
    limits = rf.RegistryLimits(max_shards=1000)
    with anyio.fail_after(30):
        async with rf.Registry.serve("tcp://127.0.0.1:*", limits=limits) as server, raw(server.address) as client:
            reply = await client.request("publish", manifest=manifest_dict(0, shards, world_size=1), owner="c")
            assert refused(reply, "ManifestError", "1001 shard specs"), reply
            assert await client.request("publish", manifest=manifest_dict(0, shards[:1000], world_size=1), owner="c")


@pytest.mark.usefixtures("store")
@pytest.mark.asyncio
async def test_a_large_manifest_is_checked_without_stalling_other_clients() -> None:
    """60,000 shard specs: the registry process checks them off its event loop; another client's round
    trips go on meanwhile (checked on the loop, none would complete until the check was done)."""
    address = free_address()
    shards = [
        [f"layers.{i}.weight", "bfloat16", [64, 64], None, 0, 64, f"{i:016x}", i, 0, *NO_TILES] for i in range(60_000)
    ]
    registry = await spawn_registry(address)
    try:
        with anyio.fail_after(120):
            async with RegistryClient(address, request_timeout_s=60) as big, RegistryClient(address) as other:
                await other.hello()
                publishing = asyncio.create_task(
                    big._request("publish", manifest=manifest_dict(0, shards, world_size=1), owner="big")
                )
                answered = 0
                while not publishing.done():
                    await other.versions(ID)  # one round trip
                    answered += 1
                await publishing
                assert answered >= 5, answered
    finally:
        await stop(registry)


@pytest.mark.usefixtures("store")
@pytest.mark.asyncio
async def test_one_client_cannot_hold_every_in_flight_slot() -> None:
    ident = {"model": "flood"}
    limits = rf.RegistryLimits(max_in_flight=8, max_in_flight_per_client=4)
    with anyio.fail_after(30):
        async with (
            rf.Registry.serve("tcp://127.0.0.1:*", limits=limits) as server,
            raw(server.address) as greedy,
            raw(server.address) as polite,
        ):
            assert (await greedy.request("register_receiver", identity=ident, receiver_id="r"))["ok"]
            for k in range(6):  # each held by the registry for 2 s (version 1 is not released)
                await greedy.sock.send(orjson.dumps({"v": PROTOCOL_VERSION, "id": k, "op": "wait_released",
                                                     "identity": ident, "version": 1, "wait_s": 2.0}))  # fmt: skip
            busy = [orjson.loads(await greedy.sock.recv()) for _ in range(2)]
            assert all(refused(r, "RefitTimeoutError", "this client has 4 requests") for r in busy), busy
            assert sorted(r["id"] for r in busy) == [4, 5]  # typed answers to the right requests
            assert (await polite.request("hello"))["ok"]  # the others are still served
            held = [orjson.loads(await greedy.sock.recv()) for _ in range(4)]
            assert [r["result"] for r in held] == [False] * 4


@pytest.mark.usefixtures("store")
@pytest.mark.asyncio
async def test_an_oversize_frame_and_a_wrong_frame_count_get_typed_answers() -> None:
    limits = rf.RegistryLimits(max_message_bytes=4096)
    with anyio.fail_after(30):
        async with (
            rf.Registry.serve("tcp://127.0.0.1:*", limits=limits) as server,
            raw(server.address) as client,
            RegistryClient(server.address) as library,
        ):
            big = orjson.dumps({"v": PROTOCOL_VERSION, "id": 3, "op": "hello", "pad": "x" * 5000})
            reply = await client.ask(big)
            assert refused(reply, "ManifestError", "over the registry's limit") and reply["id"] == 3
            assert refused(await client.ask(b"a", b"b"), "ManifestError", "one frame")
            assert (await client.request("hello"))["ok"]
            shards = tuple(
                rf.ShardSpec(name=f"w{i}", dtype="float32", global_shape=(2,), axis=None, start=0, stop=2,
                             digest=f"{i:016x}", region=i)
                for i in range(300)
            )  # fmt: skip
            large = rf.Manifest(identity=ID, version=1, rank=0, world_size=1, shards=shards,
                                source=rf.SourceAddress(transport="loopback", agent="a"))  # fmt: skip
            with pytest.raises(rf.ManifestError, match="over the registry's limit of 4096"):
                await library.publish(large)  # refused before it is sent, not a dropped connection


@pytest.mark.asyncio
async def test_cross_rank_checks_cost_one_lookup_per_tensor(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = [0]
    agree = checks.VersionIndex._agree

    def counting(*args: Any) -> None:
        calls[0] += 1
        agree(*args)

    monkeypatch.setattr(checks.VersionIndex, "_agree", counting)
    store, world, tensors = RegistryStore(), 16, 50
    for rank in range(world):
        shards = tuple(
            rf.ShardSpec(name=f"w{t}", dtype="float32", global_shape=(world, 4), axis=0, start=rank, stop=rank + 1,
                         digest="0" * 16, region=t)
            for t in range(tensors)
        )  # fmt: skip
        calls[0] = 0
        await store.publish(rf.Manifest(identity=ID, version=1, rank=rank, world_size=world, shards=shards,
                                        source=rf.SourceAddress(transport="loopback", agent=f"a{rank}")))  # fmt: skip
        assert calls[0] == (tensors if rank else 0)  # not rank × tensors
    assert store.newest_complete(ID) == 1


@pytest.mark.asyncio
async def test_publish_cost_does_not_grow_with_the_versions_held(monkeypatch: pytest.MonkeyPatch) -> None:
    store = RegistryStore()
    await store.register_receiver(ID, "slow")  # never reports: every version is kept
    for version in range(1, 501):
        await store.publish(manifest(version, 0, world=1))
    calls = [0]
    released = store._released

    def counting(*args: Any, **kwargs: Any) -> bool:
        calls[0] += 1
        return released(*args, **kwargs)

    monkeypatch.setattr(store, "_released", counting)
    await store.publish(manifest(501, 0, world=1))
    assert calls[0] <= 1 and len(await store.versions(ID)) == 501
    await store.report(ID, "slow", 499)
    assert await store.versions(ID) == [500, 501]
