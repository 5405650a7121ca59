"""A version's control traffic in proportion to what a receiver reads (the registry service, real sockets):
layouts once, then per version only a plan's part of the digests; records checked strictly, the last good
version serving; relay joins by geometry."""

from __future__ import annotations

import operator
from typing import Any

import anyio
import numpy as np
import pytest
import torch

import refitflow as rf
from refitflow.core.fanout import HeldBox, RelayOffer, RelayParam
from refitflow.core.records import Outline, RankLayout, record_of, record_to_dict
from refitflow.core.types import TILING_FIELDS
from refitflow.core.wire import Blob, encode, manifest_to_dict
from refitflow.planner.vector import digest_vector
from refitflow.registry.client.client import RegistryClient
from tests.core.test_records import _spec

ID = rf.Identity(model="partial")
PLACE = operator.attrgetter("name", *TILING_FIELDS)


def manifest(version: int, rank: int) -> rf.Manifest:
    shards = tuple(_spec(i + 100 * rank, (128, 256), True, version) for i in range(20))
    return rf.Manifest(identity=ID, version=version, rank=rank, world_size=2, shards=shards,
                       source=rf.SourceAddress(transport="loopback", agent=f"t{rank}"))  # fmt: skip


def order_of(pub: rf.Publication, picks: list[tuple[int, int]]) -> tuple[tuple[tuple[int, int, Any], ...], int]:
    """A plan's digest order reading shards ``picks`` (source, position), and its digest count."""
    order = tuple((s, p, PLACE(pub.manifests[s].shards[p])) for s, p in picks)
    return order, sum(pub.manifests[s].shards[p].tiling.count for s, p in picks)


def weights(n: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A trainer's ``n`` 64 × 64 tensors and a receiver's zeroed ones of the same names."""
    model = {f"w{i}": torch.randn(64, 64) for i in range(n)}
    return model, {name: torch.zeros(64, 64) for name in model}


def spied(client: RegistryClient, ops: list[str]) -> None:
    request = client._fetched._request

    async def spy(op: str, **args: Any) -> Any:
        ops.append(op)
        return await request(op, **args)

    client._fetched._request = spy


@pytest.mark.asyncio
async def test_a_receiver_fetches_each_layout_once_and_per_version_only_its_part() -> None:
    with anyio.fail_after(60):
        async with rf.Registry.serve("tcp://127.0.0.1:*") as server, RegistryClient(server.address) as trainer, \
                RegistryClient(server.address) as receiver, RegistryClient(server.address) as other:  # fmt: skip
            ops: list[str] = []
            spied(receiver, ops)
            picks = [(1, 3), (0, 7), (1, 4)]  # in plan order, across both ranks
            planned: Any = None  # a plan's order is the same object version after version
            for version in (1, 2, 3):
                for rank in (0, 1):
                    await trainer.publish(manifest(version, rank))
                outline = await receiver.wait_outline(ID, version, 10)
                whole = await other.wait_complete(ID, version, 10)
                assert isinstance(outline, Outline) and not outline.pending
                assert outline.revision == whole.revision
                assert [m.shards[0].digest for m in outline.manifests] == ["", ""]  # layouts: no digests
                planned = planned or order_of(whole, picks)
                order, count = planned
                want = digest_vector(whole, order, count)
                before = receiver.fetched.part_bytes
                assert np.array_equal(await outline.digests(order, count), want)  # every digest of the shards read
                assert receiver.fetched.part_bytes - before == 8 * count
                used = np.array([0, 3, count - 1])  # only these: the rest 0
                got = await outline.digests(order, count, used)
                assert np.array_equal(got[used], want[used]) and not got[np.setdiff1d(np.arange(count), used)].any()
            assert ops.count("layouts") == 1 and "publication" not in ops  # each layout once; no whole publication
            assert ops.count("part") == 6  # a part per version and plan: sent whole once each, then by its id
            assert other.fetches == 3  # a whole-publication reader fetches every digest of every version


@pytest.mark.asyncio
async def test_a_part_of_another_layout_is_refused_and_the_receiver_plans_again() -> None:
    with anyio.fail_after(60):
        async with rf.Registry.serve("tcp://127.0.0.1:*") as server, RegistryClient(server.address) as trainer, \
                RegistryClient(server.address) as receiver:  # fmt: skip
            for rank in (0, 1):
                await trainer.publish(manifest(1, rank))
            outline = await receiver.wait_outline(ID, 1, 10)
            order, count = order_of(outline, [(0, 1)])
            await outline.digests(order, count)  # the part, registered for version 1's layouts
            moved = manifest(2, 0)  # rank 0's shards elsewhere in its memory: another layout
            moved = rf.Manifest(identity=ID, version=2, rank=0, world_size=2, source=moved.source, shards=tuple(
                rf.ShardSpec(**{**vars(s), "offset": 64}) for s in moved.shards))  # fmt: skip
            await trainer.publish(moved)
            await trainer.publish(manifest(2, 1))
            layouts = await receiver.fetched.layouts([RankLayout.id_of(manifest(1, r)) for r in (0, 1)])
            with pytest.raises(rf.VersionError, match="plan again"):  # version 2 read with the plan of version 1
                await receiver.fetched._vector(ID, 2, False, layouts, order, count, None)
            fresh = await receiver.wait_outline(ID, 2, 10)
            assert fresh.manifests[0].shards[0].offset == 64
            order2, count2 = order_of(fresh, [(0, 1)])
            assert len(await fresh.digests(order2, count2)) == count2


@pytest.mark.parametrize("tamper", ["flip", "cut", "layout", "rank", "revision"])
@pytest.mark.asyncio
async def test_a_record_tampered_with_is_refused_and_the_last_good_version_serves(tamper: str) -> None:
    with anyio.fail_after(60):
        async with rf.Registry.serve("tcp://127.0.0.1:*") as server, RegistryClient(server.address) as trainer:
            for rank in (0, 1):
                await trainer.publish(manifest(1, rank))
            for rank in (0, 1):
                await trainer.publish(manifest(2, rank))  # records now: the layouts are held
            m = manifest(3, 0)
            d = record_to_dict(record_of(m, RankLayout.id_of(m)))
            raw = bytes(d["digests"].data)
            if tamper == "flip":
                d["digests"] = Blob(raw[:100] + bytes([raw[100] ^ 1]) + raw[101:])
            elif tamper == "cut":
                d["digests"] = Blob(raw[:-8])
            elif tamper == "layout":
                d["layout"] = "0" * 32
            elif tamper == "rank":
                d["layout"] = RankLayout.id_of(manifest(3, 1))
            else:
                d["revision"] = "0" * 32
            with pytest.raises(rf.ManifestError):
                await trainer._request("publish", record=d, owner=trainer.client_id)
            await trainer.publish(manifest(3, 1))  # the other rank's good record: version 3 stays incomplete
            got = await trainer.latest(ID)
            assert got is not None and got.version == 2 and got.manifests == (manifest(2, 0), manifest(2, 1))
            assert len(encode(d)) < len(encode({"m": manifest_to_dict(m)})) / 1.3  # raw digests, not base64


@pytest.mark.asyncio
async def test_a_registry_that_sends_another_layout_or_a_short_part_is_refused() -> None:
    with anyio.fail_after(60):
        async with rf.Registry.serve("tcp://127.0.0.1:*") as server, RegistryClient(server.address) as trainer, \
                RegistryClient(server.address) as receiver:  # fmt: skip
            for rank in (0, 1):
                await trainer.publish(manifest(1, rank))
            request = receiver._fetched._request

            async def swapped(op: str, **args: Any) -> Any:  # the real answers, each layout given the other's id
                found = await request(op, **args)
                return found[::-1] if op == "layouts" else found

            receiver._fetched._request = swapped
            with pytest.raises(rf.ManifestError, match="sent layout"):
                await receiver.wait_outline(ID, 1, 10)

            async def short(op: str, **args: Any) -> Any:
                found = await request(op, **args)
                return {**found, "digests": found["digests"][:-8]} if op == "part" else found

            receiver._fetched._request = short
            outline = await receiver.wait_outline(ID, 1, 10)
            order, count = order_of(outline, [(0, 2)])
            with pytest.raises(rf.ManifestError, match="digests for a part"):
                await outline.digests(order, count)


def _offer(version: int, receiver: str) -> RelayOffer:
    params = tuple(RelayParam(f"w{i}", "float32", (4, 4), i) for i in range(300))
    held = tuple(HeldBox(0, f"w{i}", ((0, 4), (0, 4)), i, ((0, 4), (0, 4))) for i in range(300))
    return RelayOffer(identity=ID, version=version, receiver=receiver, status=300, params=params, held=held,
                      source=rf.SourceAddress(transport="nixl", agent=receiver, metadata=bytes(4000)))  # fmt: skip


@pytest.mark.asyncio
async def test_a_relay_join_by_geometry_is_under_a_kilobyte_whatever_the_models_size() -> None:
    with anyio.fail_after(60):
        async with rf.Registry.serve("tcp://127.0.0.1:*") as server, RegistryClient(server.address) as a:
            await server.registry.register_receiver(ID, "r")  # every version stays held
            async with rf.Publisher(server.registry, identity=ID) as pub:
                for v in (1, 2):
                    await pub.publish(v, {f"w{i}": torch.zeros(4, 4) for i in range(300)})
            sizes: list[int] = []
            request = a._request

            async def spy(op: str, **args: Any) -> Any:
                if op == "relay_join":
                    sizes.append(len(encode({"v": 4, "id": 1, "op": op, **args})))
                return await request(op, **args)

            a._request = spy  # type: ignore[method-assign]
            assert await a.relay_join(ID, 1, "r", offer=_offer(1, "r")) is None
            assert await a.relay_join(ID, 2, "r", offer=_offer(2, "r")) is None
            # compact, refused (the registry holds no such geometry), whole once; then by geometry and address id
            assert len(sizes) == 3 and sizes[1] > 20_000 and sizes[2] < 1024, sizes
            relay = server.registry.model(ID).relays[2].offers["r"]
            assert relay.offer is None and relay.regions == ((0, 300),)  # held by geometry: O(1), not 300 tensors


@pytest.mark.asyncio
async def test_a_receiver_over_the_service_refits_from_its_part_delta_and_verified_as_before() -> None:
    """The real receiver (NIXL, a registry address): every version is planned from its layouts and checked
    against its plan's part of the digests — no whole publication fetched — and a delta refit still leaves what
    did not change, verified bytes only."""
    model, dst = weights(8)
    with anyio.fail_after(90):
        async with rf.Registry.serve("tcp://127.0.0.1:*") as server:
            async with (
                rf.Publisher(server.address, identity=ID, transport="nixl") as pub,
                rf.Receiver(dst, server.address, identity=ID, transport="nixl") as recv,
            ):
                results = []
                for version in (1, 2, 3):
                    for name in list(model)[: 4 if version > 1 else 8]:  # half of it changes after the first
                        model[name].add_(1.0)
                    await pub.publish(version, model)
                    results.append(await recv.refit(version, timeout=30))
                    assert all(torch.equal(dst[n], model[n]) for n in model)
                client = recv.registry
                assert isinstance(client, RegistryClient) and client.fetches == 0  # no whole publication, ever
                assert results[1].skipped_bytes == results[2].skipped_bytes == 4 * 64 * 64 * 4
                assert client.fetched.part_bytes < 3 * 8 * 64 * 64  # its digests, raw, a handful a tensor


@pytest.mark.asyncio
async def test_without_a_delta_decision_the_part_is_fetched_beside_the_reads_and_still_checks_every_byte() -> None:
    """``skip_unchanged=False`` over the service: nothing before the reads needs the digests, so the plan's part is
    fetched beside them (``refit.attempt.Placing``); a byte the trainer changed after publishing is still refused
    (``IntegrityError``, nothing committed) and the next version commits."""
    model, dst = weights(8)
    with anyio.fail_after(90):
        async with rf.Registry.serve("tcp://127.0.0.1:*") as server:
            async with (
                rf.Publisher(server.address, identity=ID, transport="nixl") as pub,
                rf.Receiver(dst, server.address, identity=ID, transport="nixl", skip_unchanged=False) as recv,
            ):
                await pub.publish(1, model)
                assert (await recv.refit(1, timeout=30)).version == 1
                model["w3"][5, 7] += 1.0
                await pub.publish(2, model)
                model["w3"][5, 7] += 1.0  # after its digests: the bytes read are not the version's
                with pytest.raises(rf.IntegrityError) as info:
                    await recv.refit(2, timeout=30)
                assert info.value.tensor == "w3" and recv.status.committed_version == 1
                await pub.publish(3, model)
                assert (await recv.refit(3, timeout=30)).version == 3
                assert all(torch.equal(dst[n], model[n]) for n in model)
                client = recv.registry
                assert isinstance(client, RegistryClient) and client.fetches == 0  # parts only, never a whole one


@pytest.mark.asyncio
async def test_a_version_announced_before_its_digests_is_read_early_and_checked_against_its_part() -> None:
    model, dst = weights(4)
    with anyio.fail_after(90):
        async with rf.Registry.serve("tcp://127.0.0.1:*") as server:
            async with (
                rf.Publisher(server.address, identity=ID, transport="nixl", announce_early=True) as pub,
                rf.Receiver(dst, server.address, identity=ID, transport="nixl") as recv,
            ):
                for version in (1, 2):
                    for t in model.values():
                        t.add_(1.0)
                    await pub.publish(version, model)
                    assert (await recv.refit(version, timeout=30)).version == version
                    assert all(torch.equal(dst[n], model[n]) for n in model)
                assert recv.registry.fetches == 0  # type: ignore[attr-defined]
