"""``read_start``: receivers that start reading at different points of their slices (engines spread over the
trainer's ranks) land the same bytes, over real NIXL transfers; relays read in one order and refuse it."""

from __future__ import annotations

import anyio
import pytest
import torch

import refitflow as rf
from refitflow.transports import LoopbackTransport


def _model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.weight": torch.randn(256, 64 + 8 * i, generator=g) for i in range(12)}


@pytest.mark.asyncio
async def test_receivers_starting_at_different_points_land_the_same_bytes_over_nixl(ident) -> None:
    registry = rf.Registry()
    starts = (0.0, 0.3, 0.75)
    dsts = [{n: torch.zeros_like(t) for n, t in _model(0).items()} for _ in starts]
    small = {"direct_bucket_bytes": 64 << 10, "bucket_bytes": 64 << 10}
    with anyio.fail_after(120):
        async with rf.Publisher(registry, identity=ident, transport="nixl") as pub:
            receivers = [rf.Receiver(d, registry, identity=ident, transport="nixl", read_start=s, **small)
                         for d, s in zip(dsts, starts, strict=True)]  # fmt: skip
            for r in receivers:
                await r.__aenter__()
            try:
                for version in (1, 2):
                    want = _model(version)
                    await pub.publish(version, want)
                    results = [await r.refit(version) for r in receivers]
                    assert {res.nbytes for res in results} == {sum(t.nbytes for t in want.values())}
                    for d in dsts:
                        assert all(torch.equal(d[n], t) for n, t in want.items())
                plans = [r._plans.plans()[-1] for r in receivers]  # each one's cached plan
                orders = [[p.tensor for b in plan.buckets for p in b.pieces] for plan in plans]
                assert orders[0][0] == "layers.0.weight" and len({o[0] for o in orders}) == len(starts)
                assert all(sorted(o) == sorted(orders[0]) for o in orders)
            finally:
                for r in receivers:
                    await r.__aexit__(None, None, None)


def test_a_relay_refuses_a_read_start(ident) -> None:
    with pytest.raises(rf.ConfigError, match="read_start must be 0"):
        rf.Receiver(_model(0), rf.Registry(), identity=ident, serve_replicas=True, read_start=0.5)


@pytest.mark.asyncio
async def test_a_reader_given_a_read_start_reads_the_trainer_while_another_reads_the_relay(ident) -> None:
    """A relay serves version 1; of two plain readers the one given a ``read_start`` joins no relays (from a
    relay it would wait for what that reads last) and reads everything from the trainer; the other reads
    from the relay. Both land the same bytes."""
    registry, trainer = rf.Registry(), LoopbackTransport()
    want = _model(1)
    dsts = [{n: torch.zeros_like(t) for n, t in want.items()} for _ in range(3)]
    small = {"direct_bucket_bytes": 64 << 10, "bucket_bytes": 64 << 10, "relay_bucket_bytes": 64 << 10}
    with anyio.fail_after(60):
        async with rf.Publisher(registry, identity=ident, transport=trainer) as pub:
            relay = rf.Receiver(dsts[0], registry, identity=ident, transport=LoopbackTransport(), serve_replicas=True,
                                **small)  # fmt: skip
            readers = [rf.Receiver(d, registry, identity=ident, transport=LoopbackTransport(), read_start=s, **small)
                       for d, s in zip(dsts[1:], (0.0, 0.5), strict=True)]  # fmt: skip
            async with relay, readers[0], readers[1]:
                await pub.publish(1, want)
                assert (await relay.refit(1)).relay_bytes == 0
                served = trainer.served_bytes
                plain, rotated = [await r.refit(1) for r in readers]
                total = sum(t.nbytes for t in want.values())
                assert plain.relay_bytes == total and rotated.relay_bytes == 0
                assert trainer.served_bytes - served == total  # the rotated reader's alone
                for d in dsts:
                    assert all(torch.equal(d[n], t) for n, t in want.items())
