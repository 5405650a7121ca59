"""The embedded registry: completeness, waiting, refusal of changed content, release and collection."""

from __future__ import annotations

import anyio
import pytest
import torch

import refitflow as rf
from tests.conftest import mlp


@pytest.mark.asyncio
async def test_republishing_a_version_with_other_content_is_refused(ident, registry) -> None:
    async with rf.Publisher(registry, identity=ident) as pub:
        tensors = {"w": torch.ones(4)}
        manifest = await pub.publish(1, tensors)
        await registry.publish(manifest)  # the same content again is harmless
        other = rf.Manifest(
            identity=ident, version=1, rank=0, world_size=1, source=manifest.source,
            shards=tuple(rf.ShardSpec(**{**s.__dict__, "digest": "f" * 16}) for s in manifest.shards),
        )  # fmt: skip
        with pytest.raises(rf.VersionError, match="other content"):
            await registry.publish(other)


@pytest.mark.asyncio
async def test_refit_waits_for_the_next_complete_version(ident, registry) -> None:
    trainer, server = mlp(1), mlp(2)
    with anyio.fail_after(20):
        async with (
            rf.Publisher(registry, identity=ident) as pub,
            rf.Receiver(server, registry, identity=ident) as recv,
        ):
            results = []

            async def refit() -> None:
                results.append(await recv.refit(1, timeout=10))

            async with anyio.create_task_group() as tg:
                tg.start_soon(refit)
                await anyio.wait_all_tasks_blocked()
                assert results == []
                await pub.publish(1, dict(trainer.named_parameters()))
            assert results[0].version == 1


@pytest.mark.asyncio
async def test_released_after_every_receiver_is_done_and_old_versions_dropped(ident, registry) -> None:
    trainer = mlp(1)
    servers = [mlp(2), mlp(3)]
    with anyio.fail_after(20):
        async with (
            rf.Publisher(registry, identity=ident) as pub,
            rf.Receiver(servers[0], registry, identity=ident) as r0,
            rf.Receiver(servers[1], registry, identity=ident, mode="shadow") as r1,
        ):
            await pub.publish(1, dict(trainer.named_parameters()))
            await r0.refit(1)
            with pytest.raises(rf.RefitTimeoutError):
                await pub.released(1, timeout=0.1)  # r1 has not read it yet
            await pub.publish(2, dict(mlp(4).named_parameters()))
            assert await registry.versions(ident) == [1, 2]  # superseded but not released: kept
            await r1.refit(1)
            await pub.released(1, timeout=1)
            await pub.publish(3, dict(mlp(5).named_parameters()))
            assert await registry.versions(ident) == [2, 3]  # 1: released and superseded, dropped


@pytest.mark.asyncio
async def test_incomplete_version_times_out_with_a_typed_error(ident, registry) -> None:
    async with rf.Publisher(registry, identity=ident, rank=0, world_size=2) as pub:
        await pub.publish(1, {"w": rf.Sharded(tensor=torch.ones(2, 2), axis=0, start=0, global_shape=(4, 2))})
        with anyio.fail_after(5), pytest.raises(rf.RefitTimeoutError):
            await registry.wait_complete(ident, 1, timeout=0.2)


def test_publisher_rejects_noncontiguous_tensors_instead_of_copying(ident, registry) -> None:
    async def go() -> None:
        async with rf.Publisher(registry, identity=ident) as pub:
            with pytest.raises(rf.ConfigError, match="not contiguous"):
                await pub.publish(1, {"w": torch.ones(4, 4).t()})
            # a model of more than 1,024 tensors is checked in a worker thread: the same error, nothing registered
            many = {f"t{i}": torch.ones(2) for i in range(2000)} | {"w": torch.ones(4, 4).t()}
            with pytest.raises(rf.ConfigError, match="'w' is not contiguous"):
                await pub.publish(1, many)
            assert pub.published == [] and not pub.transport._regions  # type: ignore[attr-defined]
            del many["w"]
            assert len((await pub.publish(1, many)).shards) == 2000

    anyio.run(go)


@pytest.mark.asyncio
async def test_a_laid_out_version_whose_publisher_expires_is_offered_to_nobody() -> None:
    """A version announced before its digests by a publisher whose lease then runs out: early readers
    stop seeing it (the registry drops the rank's manifest, as for a complete version)."""
    clock = [0.0]
    store = rf.Registry(lease_s=1.0, clock=lambda: clock[0])
    ident = rf.Identity(model="m")
    spec = rf.ShardSpec(name="w", dtype="uint8", global_shape=(4,), axis=None, start=0, stop=4, digest="", region=0)
    m = rf.Manifest(identity=ident, version=1, rank=0, world_size=1, shards=(spec,),
                    source=rf.SourceAddress(transport="loopback", agent="a"))  # fmt: skip
    await store.publish(m, owner="trainer")
    early = await store.latest(ident, early=True)
    assert early is not None and early.pending and await store.latest(ident) is None
    clock[0] = 5.0
    assert store.expire() == ["trainer"]
    assert await store.latest(ident, early=True) is None and await store.versions(ident) == []
