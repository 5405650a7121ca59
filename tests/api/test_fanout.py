"""Tree fan-out in one process (loopback): receivers that committed serve the version to others."""

from __future__ import annotations

import anyio
import pytest
import torch

import refitflow as rf
from refitflow.transports import LoopbackTransport
from tests.conftest import mlp, params, same


def _model_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.asyncio
async def test_replicas_keep_trainer_egress_near_one_copy_and_every_receiver_is_bit_exact() -> None:
    registry, ident = rf.Registry(), rf.Identity(model="fanout")
    trainer = mlp(100)
    servers = [mlp(i) for i in range(4)]
    trainer_transport = LoopbackTransport()
    transports = [LoopbackTransport() for _ in servers]
    with anyio.fail_after(30):
        async with rf.Publisher(registry, identity=ident, transport=trainer_transport) as pub:
            receivers = [
                rf.Receiver(s, registry, identity=ident, mode="shadow", transport=t, serve_replicas=True)
                for s, t in zip(servers, transports, strict=True)
            ]
            for r in receivers:
                await r.__aenter__()
            try:
                await pub.publish(1, dict(trainer.named_parameters()))
                for r in receivers:  # in waves of one: each commits, then serves the next
                    await r.refit(1)
                pubn = await registry.latest(ident, 1)
                assert pubn is not None and len(pubn.replicas) == 4
                delivered = sum(t.served_bytes for t in [trainer_transport, *transports])
                assert delivered == 4 * _model_bytes(trainer)
                assert trainer_transport.served_bytes <= 1.5 * _model_bytes(trainer), trainer_transport.served_bytes
                expected = params(trainer)
                assert all(same(s, expected) for s in servers)
                # beginning the next version withdraws the replica: it never serves bytes under change
                await pub.publish(2, dict(mlp(101).named_parameters()))
                await receivers[0].refit(2)
                latest = await registry.latest(ident, 2)
                assert latest is not None and [m.metadata["replica"] for m in latest.replicas] == [
                    receivers[0].receiver_id
                ]
            finally:
                for r in receivers:
                    await r.__aexit__(None, None, None)


@pytest.mark.asyncio
async def test_a_replica_that_dies_mid_serve_makes_its_reader_read_from_the_trainer() -> None:
    registry, ident = rf.Registry(), rf.Identity(model="fanout")
    trainer, first, second = mlp(100), mlp(1), mlp(2)
    trainer_transport = LoopbackTransport()
    with anyio.fail_after(30):
        async with (
            rf.Publisher(registry, identity=ident, transport=trainer_transport) as pub,
            rf.Receiver(first, registry, identity=ident, mode="shadow", serve_replicas=True) as a,
            rf.Receiver(second, registry, identity=ident, mode="shadow", budget_bytes=4096) as b,
        ):
            await pub.publish(1, dict(trainer.named_parameters()))
            await a.refit(1)
            assert a._transport is not None
            await a._transport.aclose()  # the replica dies without withdrawing (still offered)
            latest = await registry.latest(ident, 1)
            assert latest is not None and len(latest.replicas) == 1
            result = await b.refit(1)
            assert result.version == 1 and same(second, params(trainer))
            assert trainer_transport.served_bytes == 2 * _model_bytes(trainer)  # b's reads all came from it


@pytest.mark.asyncio
async def test_a_replica_must_match_the_published_digests(ident: rf.Identity) -> None:
    registry = rf.Registry()
    trainer = mlp(100)
    async with rf.Publisher(registry, identity=ident) as pub:
        await pub.publish(1, dict(trainer.named_parameters()))
        published = await registry.latest(ident, 1)
        assert published is not None
        m = published.manifests[0]
        bad = rf.Manifest(identity=ident, version=1, rank=0, world_size=1, source=m.source,
                          shards=m.shards[1:], metadata={"replica": "r"})  # fmt: skip
        with pytest.raises(rf.ManifestError):
            await registry.publish_replica(bad)
