"""Tree fan-out over NIXL: 1 trainer process + 4 receiver processes, registry served from here.

Bytes are counted by their actual source: every READ carries a notification of its size to the
agent it read from (``Transport.served_bytes``).
"""

from __future__ import annotations

import socket

import anyio
import pytest
import torch
from _nixl_peer import Peer, model
from _nixl_receiver import ReceiverProc
from test_nixl_xproc import KillBefore, served_at_least

import refitflow as rf

SPEC = {"tensors": 64, "numel": 4000, "model": "fanout"}
MODEL_BYTES = sum((SPEC["numel"] + i % 7) * 4 for i in range(SPEC["tensors"]))


def same(dst: dict[str, torch.Tensor], seed: int) -> bool:
    return all(torch.equal(dst[n], t) for n, t in model(SPEC, seed).items())


def _address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.asyncio
async def test_four_receivers_cost_the_trainer_under_two_model_copies_and_are_bit_exact() -> None:
    address = _address()
    with anyio.fail_after(120):
        async with rf.Registry.serve(address) as server, Peer(SPEC) as trainer:
            await server.registry.publish(await trainer.publish(1, 31))
            async with (
                ReceiverProc(SPEC, address) as r0, ReceiverProc(SPEC, address) as r1,
                ReceiverProc(SPEC, address) as r2, ReceiverProc(SPEC, address) as r3,
            ):  # fmt: skip
                results = [await r0.refit(1, 31), await r1.refit(1, 31)]  # waves: 1, 1, then 2 at once
                async with anyio.create_task_group() as tg:
                    for r in (r2, r3):
                        tg.start_soon(lambda r=r: _collect(results, r))
                assert all(res["exact"] and res["version"] == 1 for res in results), results
                delivered = 4 * MODEL_BYTES
                by_source = [await served_at_least(trainer, 0)] + [await r.served() for r in (r0, r1, r2, r3)]
                by_source[0] = await served_at_least(trainer, delivered - sum(by_source[1:]))
                assert sum(by_source) == delivered, by_source
                assert by_source[0] <= 2 * MODEL_BYTES, by_source  # not 4 copies


async def _collect(results: list[dict], r: ReceiverProc) -> None:
    results.append(await r.refit(1, 31))


@pytest.mark.asyncio
async def test_a_dead_replica_still_offered_makes_its_reader_read_from_the_trainer() -> None:
    address = _address()
    with anyio.fail_after(120):
        async with rf.Registry.serve(address) as server, Peer(SPEC) as trainer:
            await server.registry.publish(await trainer.publish(1, 41))
            async with ReceiverProc(SPEC, address) as replica, ReceiverProc(SPEC, address) as reader:
                assert (await replica.refit(1, 41))["exact"]
                await replica.kill()  # still offered: its lease has not run out
                pub = await server.registry.latest(rf.Identity(model="fanout"), 1)
                assert pub is not None and len(pub.replicas) == 1
                with anyio.fail_after(30):  # the reader's own refit deadline
                    result = await reader.refit(1, 41)
                assert result["exact"] and result["version"] == 1


@pytest.mark.asyncio
async def test_a_replica_killed_mid_serve_makes_its_reader_finish_from_the_trainer() -> None:
    address = _address()
    ident = rf.Identity(model="fanout")
    dst = {n: torch.zeros_like(t) for n, t in model(SPEC, 0).items()}
    transport = KillBefore(nth=3)  # two buckets land, then the replica dies before the third
    with anyio.fail_after(120):
        async with rf.Registry.serve(address) as server, Peer(SPEC) as trainer:
            await server.registry.publish(await trainer.publish(1, 51))
            async with ReceiverProc(SPEC, address) as replica:
                assert (await replica.refit(1, 51))["exact"]
                transport.action = replica.kill
                async with rf.Receiver(dst, server.registry, identity=ident, transport=transport, mode="shadow",
                                       direct_bucket_bytes=32 * 1024, read_timeout_s=10.0) as reader:  # fmt: skip
                    with anyio.fail_after(30):  # well inside the reader's own refit deadline
                        result = await reader.refit(1)
            assert transport.calls > 3 and result.version == 1 and same(dst, 51)
            expected = sum(t.nbytes for t in dst.values())
            assert await served_at_least(trainer, 2 * expected) < 2 * expected  # the replica served a part
