"""Pipelined fan-out over NIXL: 1 trainer process + receiver processes that relay, registry served from here.

The trainer's egress is counted by its own agent: every READ of it carries a notification of its size
(``Transport.served_bytes``); reads of a relay are counted by their readers (``RefitResult.relay_bytes``).
Receivers start together: each relays what it has verified before it commits, so the trainer serves
about one model copy.
"""

from __future__ import annotations

import socket

import anyio
import pytest
from _nixl_peer import Peer
from _nixl_receiver import ReceiverProc
from test_nixl_xproc import served_at_least

import refitflow as rf

SPEC = {"tensors": 64, "numel": 4000, "model": "fanout"}
MODEL_BYTES = sum((SPEC["numel"] + i % 7) * 4 for i in range(SPEC["tensors"]))
SMALL = {"relay_bucket_bytes": 64 * 1024}  # 16 tensors a bucket: relays report progress bucket by bucket


def _address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


async def _together(receivers: list[ReceiverProc], version: int, seed: int, **content: int) -> list[dict]:
    results: list[dict] = []

    async def one(r: ReceiverProc) -> None:
        results.append(await r.refit(version, seed, **content))

    async with anyio.create_task_group() as tg:
        for r in receivers:
            tg.start_soon(one, r)
    return results


@pytest.mark.asyncio
async def test_four_receivers_starting_together_cost_the_trainer_one_copy_and_are_bit_exact() -> None:
    address = _address()
    with anyio.fail_after(150):
        async with rf.Registry.serve(address) as server, Peer(SPEC) as trainer:
            await server.registry.publish(await trainer.publish(1, 31))
            async with (
                ReceiverProc(SPEC, address, **SMALL) as r0, ReceiverProc(SPEC, address, **SMALL) as r1,
                ReceiverProc(SPEC, address, **SMALL) as r2, ReceiverProc(SPEC, address, **SMALL) as r3,
            ):  # fmt: skip
                results = await _together([r0, r1, r2, r3], 1, 31)
                assert all(res["exact"] and res["version"] == 1 for res in results), results
                assert sum(res["relay_bytes"] > 0 for res in results) == 3, results  # a chain from the trainer
                relayed = sum(res["relay_bytes"] for res in results)  # reads of a relay notify nobody (no wait on it)
                egress = await served_at_least(trainer, 4 * MODEL_BYTES - relayed)
                assert egress + relayed == 4 * MODEL_BYTES, (egress, relayed)  # every byte came from one of them
                assert egress <= 1.5 * MODEL_BYTES, (egress / MODEL_BYTES, results)
                # a delta refit: half the tensors keep their bytes; nobody reads them, the rest is relayed
                await server.registry.publish(await trainer.publish(2, 32, frozen=32))
                before = await trainer.served()
                results = await _together([r0, r1, r2, r3], 2, 32, frozen=32, base=31)
                frozen = sum((SPEC["numel"] + i % 7) * 4 for i in range(32))
                assert all(res["exact"] and res["skipped_bytes"] == frozen for res in results), results
                assert all(res["nbytes"] == MODEL_BYTES - frozen for res in results), results
                relayed = sum(res["relay_bytes"] for res in results)
                egress = await served_at_least(trainer, before + 4 * results[0]["nbytes"] - relayed) - before
                assert egress <= 0.75 * MODEL_BYTES, (egress / MODEL_BYTES, results)


@pytest.mark.asyncio
async def test_a_relay_killed_mid_serve_makes_its_readers_reroute_and_all_commit() -> None:
    address = _address()
    with anyio.fail_after(150):
        async with rf.Registry.serve(address) as server, Peer(SPEC) as trainer:
            await server.registry.publish(await trainer.publish(1, 41))
            # the first relay reads slowly (each read 50 ms late): the others catch up and wait on it
            async with (
                ReceiverProc(SPEC, address, read_delay_s=0.05, **SMALL) as slow,
                ReceiverProc(SPEC, address, relay_wait_s=60.0, **SMALL) as r1,
                ReceiverProc(SPEC, address, relay_wait_s=60.0, **SMALL) as r2,
            ):
                results: list[dict] = []
                both = anyio.Event()

                async def one(r: ReceiverProc) -> None:
                    results.append(await r.refit(1, 41))
                    if len(results) == 2:
                        both.set()

                async def doomed() -> None:
                    with pytest.raises((anyio.IncompleteRead, anyio.EndOfStream)):
                        await slow.refit(1, 41)  # its answer never comes: it is killed below

                async with anyio.create_task_group() as tg:
                    tg.start_soon(doomed)
                    await served_at_least(trainer, MODEL_BYTES // 4, timeout=60)  # polled: another process
                    tg.start_soon(one, r1)
                    tg.start_soon(one, r2)
                    await served_at_least(trainer, MODEL_BYTES // 2, timeout=60)
                    await slow.kill()  # mid-serve: r1 waits on it for the rest (relay_wait_s is long)
                    await both.wait()
            assert all(res["exact"] and res["version"] == 1 for res in results), results
            assert sum(res["rerouted_bytes"] > 0 for res in results) >= 1, results
            assert sum(res["relay_bytes"] > 0 for res in results) == 2, results


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", ["in_place", "shadow"])
async def test_a_relay_whose_bytes_change_is_never_committed_from_and_its_reader_reroutes(mode: str) -> None:
    address = _address()
    with anyio.fail_after(120):
        async with rf.Registry.serve(address) as server, Peer(SPEC) as trainer:
            await server.registry.publish(await trainer.publish(1, 51))
            async with ReceiverProc(SPEC, address, mode=mode) as relay, ReceiverProc(SPEC, address) as reader:
                assert (await relay.refit(1, 51))["exact"]  # it serves version 1 until its next refit
                await relay.corrupt("layers.5.weight")  # behind refitflow's back, after it verified the bytes
                result = await reader.refit(1, 51)
                assert result["exact"] and result["relay_bytes"] > 0, result
                assert result["rerouted_bytes"] >= 4 * SPEC["numel"], result  # the tensor, again from the trainer
