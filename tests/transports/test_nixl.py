"""NIXL transport in one process: two agents, real UCX (cma) READs between them."""

from __future__ import annotations

import gc

import anyio
import pytest
import torch

import refitflow as rf
from refitflow.transports import make_transport
from refitflow.transports.base import Read, as_bytes
from refitflow.transports.nixl import NixlTransport


def weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(96, 40, generator=g),
        "layers.0.attn.weight": torch.randn(40, 40, generator=g).to(torch.bfloat16),
        "layers.0.mlp.weight": torch.randn(160, 40, generator=g),
        "layers.0.norm.weight": torch.randn(40, generator=g),
        "head.bias": torch.randint(-100, 100, (17,), generator=g, dtype=torch.int64),
    }


def bits_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return set(a) == set(b) and all(torch.equal(as_bytes(a[n]), as_bytes(b[n])) for n in a)


def test_make_transport_builds_a_nixl_agent() -> None:
    assert isinstance(make_transport("nixl"), NixlTransport)


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", ["in_place", "shadow"])
async def test_refit_over_nixl_is_bit_exact_and_replays_descriptors(mode: str) -> None:
    registry, ident = rf.Registry(), rf.Identity(model="nixl-inproc")
    src = weights(0)
    dst = {n: torch.zeros_like(t) for n, t in src.items()}
    receiver_transport = NixlTransport()
    with anyio.fail_after(30):
        async with (
            rf.Publisher(registry, identity=ident, transport="nixl") as pub,
            rf.Receiver(dst, registry, identity=ident, transport=receiver_transport, mode=mode) as recv,
        ):
            prepared = []
            for version in (1, 2, 3, 4):
                for name, t in weights(version).items():
                    src[name].copy_(t)  # same storages: the plan and the descriptors replay
                await pub.publish(version, src)
                result = await recv.refit(version)
                await pub.released(version, timeout=10)
                assert bits_equal(dst, src)
                assert result.plan_cached == (version > 1)
                prepared.append(receiver_transport.prepared)
            # in place lands in one storage; shadow alternates two: prepared once per storage
            assert prepared[1:] == [prepared[0]] * 3 if mode == "in_place" else prepared[2:] == [prepared[1]] * 2
            assert recv.status.fence == "ready"


@pytest.mark.asyncio
async def test_storage_change_between_versions_reads_the_new_storage() -> None:
    registry, ident = rf.Registry(), rf.Identity(model="nixl-storage")
    src = weights(10)
    dst = {n: torch.zeros_like(t) for n, t in src.items()}
    with anyio.fail_after(30):
        async with (
            rf.Publisher(registry, identity=ident, transport="nixl") as pub,
            rf.Receiver(dst, registry, identity=ident, transport="nixl", mode="shadow") as recv,
        ):
            await pub.publish(1, src)
            await recv.refit(1)
            await pub.released(1, timeout=10)
            for version in (2, 3):
                # the trainer replaces a tensor with a new one at a new address; the old one is freed
                # and its memory reused with garbage (a stale descriptor would read that garbage)
                old = src["layers.0.mlp.weight"]
                old_ptr = old.data_ptr()
                src["layers.0.mlp.weight"] = weights(10 + version)["layers.0.mlp.weight"].clone()
                assert src["layers.0.mlp.weight"].data_ptr() != old_ptr
                await pub.publish(version, src)
                del old
                gc.collect()
                garbage = [torch.full((160, 40), float("nan")) for _ in range(4)]
                result = await recv.refit(version)  # digest verified by the pipeline
                await pub.released(version, timeout=10)
                assert result.version == version and bits_equal(dst, src)
                del garbage


async def _strided(kind: str, src: torch.Tensor, dst: torch.Tensor, want: torch.Tensor,
                   read: tuple[int, int, int, int], overrun: tuple[int, int, int, int]) -> None:  # fmt: skip
    """``read`` (offset, run, stride, count) of ``src`` lands ``want`` in ``dst`` prepared, replayed and unprepared;
    ``overrun`` is refused."""
    make = NixlTransport if kind == "nixl" else rf.LoopbackTransport
    owner, reader = make(), make()
    try:
        with anyio.fail_after(20):
            region = owner.register(src)
            reader.register(dst)
            reader.connect(owner.address())
            offset, run, stride, count = read
            one = Read(owner.agent, region, offset, run, as_bytes(dst), stride=stride, count=count)
            for key in ("strided", "strided", None):  # prepared, replayed, unprepared
                dst.zero_()
                await reader.read([one], key=key)
                assert torch.equal(dst, want)
            offset, run, stride, count = overrun
            with pytest.raises(rf.TransportError, match="outside region"):
                await reader.read([Read(owner.agent, region, offset, run, as_bytes(dst), stride=stride, count=count)])
    finally:
        await reader.aclose()
        await owner.aclose()


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["nixl", "loopback"])
async def test_a_strided_read_lands_a_column_slice_back_to_back(kind: str) -> None:
    src = torch.arange(64 * 48, dtype=torch.int32).reshape(64, 48)  # rows of 192 bytes
    dst = torch.zeros(64, 16, dtype=torch.int32)
    # columns 8..24 of every row: 64 runs of 64 bytes, 192 bytes apart, as one read; from column 40 the last
    # run would overrun
    await _strided(kind, src, dst, src[:, 8:24], (8 * 4, 16 * 4, 48 * 4, 64), (40 * 4, 16 * 4, 48 * 4, 64))


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["nixl", "loopback"])
async def test_a_read_with_a_negative_stride_lands_a_reversed_buffers_tensors_in_order(kind: str) -> None:
    """Megatron's DDP buffer holds a layer's experts last first: one read, runs downwards, lands them in order."""
    experts = torch.arange(8 * 96, dtype=torch.int32).reshape(8, 96)
    buffer = experts.flip(0).contiguous()  # expert 7 first, as the trainer's buffer lays them
    dst = torch.zeros(5, 96, dtype=torch.int32)
    row = 96 * 4
    down = Read("owner", 0, 5 * row, row, as_bytes(dst), stride=-row, count=5)
    assert (down.low, down.extent) == (row, 5 * row)
    # experts 2..6 in order: the first at row 5 of the buffer, each next one a row lower; from row 3 the fifth
    # run would start below 0
    await _strided(kind, buffer, dst, experts[2:7], (5 * row, row, -row, 5), (3 * row, row, -row, 5))


@pytest.mark.asyncio
async def test_reads_coalesce_and_refuse_unregistered_or_out_of_range_memory() -> None:
    owner, reader = NixlTransport(), NixlTransport()
    src = torch.arange(4096, dtype=torch.uint8)
    dst = torch.zeros(4096, dtype=torch.uint8)
    stray = torch.zeros(64, dtype=torch.uint8)
    try:
        with anyio.fail_after(20):
            region = owner.register(src)
            assert owner.register(src) == region  # idempotent per storage
            reader.register(dst)
            reader.connect(owner.address())
            reader.connect(owner.address())  # same metadata: nothing to do
            d = as_bytes(dst)
            reads = [Read(owner.agent, region, o, 512, d[o : o + 512]) for o in range(0, 4096, 512)]
            await reader.read(reads[::-1] + reads[:1], key="k")  # out of order, one range twice
            assert torch.equal(dst, src)
            await reader.read([Read(owner.agent, region, 100, 7, d[:7])], key=None)
            assert torch.equal(dst[:7], src[100:107])
            with pytest.raises(rf.TransportError, match="not inside registered memory"):
                await reader.read([Read(owner.agent, region, 0, 64, as_bytes(stray))])
            with pytest.raises(rf.TransportError, match="outside region"):
                await reader.read([Read(owner.agent, region, 4090, 64, d[:64])])
            with pytest.raises(rf.TransportError, match="not connected"):
                await reader.read([Read("nobody", region, 0, 64, d[:64])])
            # a new registration changes the address; the reader refreshes and reads the new memory
            late = torch.full((100,), 7, dtype=torch.uint8)
            late_region = owner.register(late)
            with pytest.raises(rf.TransportError, match="no region"):
                await reader.read([Read(owner.agent, late_region, 0, 100, d[:100])])
            reader.connect(owner.address())
            await reader.read([Read(owner.agent, late_region, 0, 100, d[:100])], key="late")
            assert torch.equal(dst[:100], late)
    finally:
        await reader.aclose()
        await owner.aclose()
    with pytest.raises(rf.TransportError, match="closed"):
        reader.register(dst)


@pytest.mark.asyncio
async def test_reads_striped_over_two_agents_are_bit_exact_and_replayed() -> None:
    owner, reader = NixlTransport(), NixlTransport(num_agents=2)
    src = torch.randint(0, 256, (12 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    dst = torch.zeros_like(src)
    try:
        with anyio.fail_after(20):
            region = owner.register(src)
            reader.register(dst)
            reader.connect(owner.address())
            half = 6 << 20
            reads = [Read(owner.agent, region, 0, half, dst[:half]), Read(owner.agent, region, half, half, dst[half:])]
            for _ in range(3):
                src.add_(1)
                await reader.read(reads, key="big")  # coalesced to one range, cut in two, one per agent
                assert torch.equal(dst, src)
            assert reader.prepared == 2
    finally:
        await reader.aclose()
        await owner.aclose()


@pytest.mark.asyncio
async def test_a_refreshed_peer_address_invalidates_prepared_descriptors() -> None:
    owner, reader = NixlTransport(), NixlTransport()
    n = 1 << 20
    dst = torch.zeros(n, dtype=torch.uint8)
    try:
        with anyio.fail_after(20):
            old = torch.full((n,), 3, dtype=torch.uint8)
            region = owner.register(old)
            reader.register(dst)
            reader.connect(owner.address())
            await reader.read([Read(owner.agent, region, 0, n, dst)], key="k")
            assert bool((dst == 3).all()) and reader.prepared == 1
            # the owner swaps storages; the new one may well sit at the old address (same descriptors)
            owner.deregister(region)
            del old
            gc.collect()
            new = torch.full((n,), 9, dtype=torch.uint8)
            region = owner.register(new)
            reader.connect(owner.address())
            await reader.read([Read(owner.agent, region, 0, n, dst)], key="k")
            assert torch.equal(dst, new) and reader.prepared == 2  # prepared afresh, not replayed
    finally:
        await reader.aclose()
        await owner.aclose()


@pytest.mark.asyncio
async def test_a_key_read_from_peer_after_peer_keeps_the_last_two_peers_preparations() -> None:
    """A relay reader's relay changes from version to version: the same key read from one peer after another
    keeps only its two most recently read peers' preparations (not one a peer it ever read), and a peer read
    again after it was let go is prepared afresh and lands right; a key read from several peers at once (a
    bucket of a sharded trainer) keeps every one of them."""
    owners, reader = [NixlTransport() for _ in range(3)], NixlTransport()
    n = 1 << 20
    dst = torch.zeros(n, dtype=torch.uint8)
    try:
        with anyio.fail_after(30):
            srcs = [torch.full((n,), i + 1, dtype=torch.uint8) for i in range(3)]
            regions = [o.register(s) for o, s in zip(owners, srcs, strict=True)]
            reader.register(dst)
            for o in owners:
                reader.connect(o.address())

            async def read_from(i: int) -> None:
                await reader.read([Read(owners[i].agent, regions[i], 0, n, dst)], key=("plan", "bucket"))
                assert bool((dst == i + 1).all())

            seen = []
            for i in (0, 1, 1, 2, 1, 0):
                await read_from(i)
                seen.append((reader.prepared, reader.kept))
            # 0 and 1 prepared; 1 replayed; 2 prepared, 0 let go; 1 replayed (still kept); 0 prepared afresh
            assert seen == [(1, 1), (2, 2), (2, 2), (3, 2), (3, 2), (4, 2)], seen
            # a key read from three peers at once (a bucket of a sharded trainer) keeps all three, read after read
            third = n // 3
            for _ in range(3):
                dst.zero_()
                each = [Read(owners[i].agent, regions[i], 0, third, dst[i * third : (i + 1) * third]) for i in range(3)]
                await reader.read(each, key=("plan", "sharded"))  # a new list each time: no replay of the batch
                assert all(bool((dst[i * third : (i + 1) * third] == i + 1).all()) for i in range(3))
            assert reader.prepared == 7 and reader.kept == 5, (reader.prepared, reader.kept)
            reader.forget("plan")
            assert reader.kept == 0
    finally:
        await reader.aclose()
        for o in owners:
            await o.aclose()


@pytest.mark.asyncio
async def test_a_read_in_flight_when_its_peers_connection_is_dropped_lands_over_a_new_one() -> None:
    """With buckets in flight, one read that finds a peer dead drops its connection under the others (after a
    partition healed): NIXL then refuses their stale handles (``NIXL_ERR_NOT_FOUND``, not a disconnection), and
    they are read again over a new connection, as a disconnected one is."""
    owner, reader = NixlTransport(), NixlTransport()
    n = 16 << 20
    src = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    dst = torch.zeros_like(src)
    try:
        with anyio.fail_after(30):
            region = owner.register(src)
            reader.register(dst)
            reader.connect(owner.address())
            reads = [Read(owner.agent, region, 0, n, dst)]
            await reader.read(reads, key="k")
            for _ in range(3):
                src.add_(1)
                submitted = await reader.submit(reads, key="k")
                reader.reconnect([owner.agent])  # what another bucket's failed read (or the next attempt) does
                await submitted.wait()
                assert torch.equal(dst, src)
    finally:
        await reader.aclose()
        await owner.aclose()
