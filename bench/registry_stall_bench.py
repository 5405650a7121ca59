"""How long another client waits while the registry takes a large or hostile frame.

    PYTHONPATH=src:. python bench/registry_stall_bench.py [--rows 700000] [--specs 100000]

The registry runs in its own process (``refitflow registry``). A prober sends ``versions`` round trips
back to back and records each; meanwhile one frame is sent: a hostile one of ``--rows`` rows (under the
frame limit, over the shard-spec limit: refused after counting) and a legitimate manifest of ``--specs``
shard specs (decoded as a stream, checked in a worker thread). Prints the prober's p50/p99/max round trip
with no frame, during each; and whether a 2 s lease held through both.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import orjson
import zmq
import zmq.asyncio

import refitflow as rf
from bench.registry_bench import spawn_registry
from refitflow.core.wire import PROTOCOL_VERSION
from refitflow.registry.client.client import RegistryClient
from tests.registry.test_registry_client import manifest
from tests.registry.test_registry_hostile import NO_TILES
from tests.registry.test_registry_hostile import manifest as manifest_dict

ID = rf.Identity(model="m")


def rows(n: int) -> list[list[object]]:
    return [[f"layers.{i}.weight", "bfloat16", [64, 64], None, 0, 64, f"{i:016x}", i, 0, *NO_TILES] for i in range(n)]


async def probe(client: RegistryClient, until: asyncio.Task[object] | None, seconds: float = 1.0) -> list[float]:
    took: list[float] = []
    end = time.perf_counter() + seconds
    while (until is not None and not until.done()) or (until is None and time.perf_counter() < end):
        t = time.perf_counter()
        await client.versions(ID)
        took.append(time.perf_counter() - t)
    return took


def show(name: str, took: list[float]) -> None:
    took.sort()
    p99 = took[min(len(took) - 1, int(0.99 * len(took)))]
    print(f"{name:<44} {len(took):6d} round trips  p50 {statistics.median(took) * 1e3:7.2f} ms  "
          f"p99 {p99 * 1e3:7.2f} ms  max {took[-1] * 1e3:7.2f} ms")  # fmt: skip


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=700_000)
    parser.add_argument("--specs", type=int, default=100_000)
    args = parser.parse_args()
    proc, address = await spawn_registry("--lease-s", "2")
    ctx = zmq.asyncio.Context()
    sender = ctx.socket(zmq.DEALER)
    sender.connect(address)
    try:
        async with RegistryClient(address, heartbeat_s=0.25) as holder, RegistryClient(address) as prober:
            await holder.publish(manifest(1, 0, world=1))
            show("no frame", await probe(prober, None))
            frames = {
                f"hostile: {args.rows:,} rows (refused)": {"manifest": manifest_dict(0, rows(1) * args.rows,
                                                                                      world_size=1)},
                f"legitimate: {args.specs:,} shard specs": {"manifest": manifest_dict(0, rows(args.specs),
                                                            world_size=1) | {"identity": {"model": "big"}}},
            }  # fmt: skip
            for name, body in frames.items():
                frame = orjson.dumps({"v": PROTOCOL_VERSION, "id": 1, "op": "publish", "owner": "bench", **body})

                async def send(frame: bytes = frame) -> object:
                    await sender.send(frame)
                    return orjson.loads(await sender.recv())

                task = asyncio.create_task(send())
                took = await probe(prober, task)
                reply = await task
                show(f"{name} ({len(frame) / 2**20:.0f} MiB)", took)
                print(f"  answer: ok={reply['ok']} {reply.get('message', '')[:90]}")  # type: ignore[index]
            print(f"the 2 s lease held: {(await prober.latest(ID)) is not None}")
    finally:
        ctx.destroy(linger=0)
        proc.terminate()
        await proc.wait()


if __name__ == "__main__":
    asyncio.run(main())
