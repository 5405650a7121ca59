"""The registry with 1,000 receivers: in memory vs on etcd, same run.

    PYTHONPATH=src:. python bench/registry_etcd_bench.py [--receivers 1000] [--tensors 100] [--members 3]

Each store is served by ``refitflow registry`` in its own process (etcd: ``--store etcd://…`` on a
``--members``-member etcd cluster on loopback, started here). The receivers are tasks of this process,
each a ``RegistryClient`` of its own (real sockets, one ZMQ context). Every receiver, all at once, phase
by phase: **join** (register), **fetch** (discover version 1 of a 2-rank publication of ``--tensors``
tensors: ``latest`` and its manifests), **relay** (join the version's relays), **release** (report it
done), **heartbeat** (three rounds). Prints p50/p99 latency per operation and the phase's throughput;
and the size of a manifest of 10,000 and 60,000 tensors as written to etcd (chunks of ≤ 1 MiB).
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import zmq
import zmq.asyncio

import refitflow as rf
from bench.registry_bench import spawn_registry
from refitflow.core.types import Manifest, ShardSpec, SourceAddress
from refitflow.core.wire import encode, manifest_to_dict
from refitflow.registry.client import RegistryClient
from refitflow.registry.service.etcd.keys import CHUNK_BYTES
from tests.registry._etcd import loopback

ID = rf.Identity(model="bench")


def manifest(version: int, rank: int, tensors: int, world: int = 2) -> Manifest:
    shards = tuple(ShardSpec(name=f"layers.{i}.weight", dtype="bfloat16", global_shape=(128 * world, 64), axis=0,
                             start=128 * rank, stop=128 * (rank + 1), digest="0123456789abcdef", region=0)
                   for i in range(tensors))  # fmt: skip
    return Manifest(identity=ID, version=version, rank=rank, world_size=world, shards=shards,
                    source=SourceAddress(transport="loopback", agent=f"bench{rank}"))  # fmt: skip


def more_files() -> None:
    """1,000 clients and their connections need more descriptors than the usual soft limit of 1,024."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 65536), hard))


def _report(c: RegistryClient) -> Callable[..., Awaitable[object]]:
    """The client's own delivery of a report (waited for: the registry's write is timed), in either tree."""
    return getattr(c, "_send_report", None) or c._upkeep.send_report


async def phase(name: str, clients: list[RegistryClient], op: Callable[[int, RegistryClient], Awaitable[object]],
                rounds: int = 1) -> None:  # fmt: skip
    took: list[float] = []

    async def one(i: int, c: RegistryClient) -> None:
        for _ in range(rounds):
            t = time.perf_counter()
            await op(i, c)
            took.append(time.perf_counter() - t)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i, c) for i, c in enumerate(clients)))
    wall = time.perf_counter() - t0
    took.sort()
    p50, p99 = statistics.median(took), took[min(len(took) - 1, int(0.99 * len(took)))]
    print(f"  {name:<10} p50 {p50 * 1e3:8.1f} ms   p99 {p99 * 1e3:8.1f} ms   {len(took) / wall:8.0f} ops/s")


async def run(store: str, flags: list[str], receivers: int, tensors: int) -> None:
    proc, address = await spawn_registry("--lease-s", "60", *flags, preexec_fn=more_files)
    ctx = zmq.asyncio.Context()
    ctx.set(zmq.MAX_SOCKETS, 16 * receivers + 1024)
    clients = [RegistryClient(address, context=ctx, request_timeout_s=60, heartbeat_s=3600) for _ in range(receivers)]
    try:
        print(f"{store}: {receivers} receivers, a 2-rank version of {tensors} tensors")
        await phase("join", clients, lambda i, c: c.register_receiver(ID, f"r{i}"))
        async with RegistryClient(address, context=ctx) as trainer:
            for rank in range(2):
                await trainer.publish(manifest(1, rank, tensors))
            await phase("fetch", clients, lambda i, c: c.wait_complete(ID, 1, 60))
            await phase("relay", clients, lambda i, c: c.relay_join(ID, 1, f"r{i}"))
            await phase("release", clients, lambda i, c: _report(c)(ID, f"r{i}", 1, 60))
            await phase("heartbeat", clients, lambda i, c: c._request("heartbeat", owner=c.client_id), rounds=3)
            assert await trainer.acked(ID, 1) == (receivers, receivers)
    finally:
        await asyncio.gather(*(c.aclose() for c in clients))
        ctx.term()
        proc.terminate()
        await proc.wait()


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--receivers", type=int, default=1000)
    parser.add_argument("--tensors", type=int, default=100)
    parser.add_argument("--members", type=int, default=3)
    args = parser.parse_args()
    more_files()
    for n in (10_000, 60_000):
        size = len(encode({"manifest": manifest_to_dict(manifest(1, 0, n, world=1))}))
        print(f"a manifest of {n} tensors: {size / 1e6:.2f} MB in etcd, {-(-size // CHUNK_BYTES)} chunk(s)")
    with tempfile.TemporaryDirectory() as tmp:
        cluster = loopback(Path(tmp), args.members)
        try:
            await run("in memory", [], args.receivers, args.tensors)
            await run(f"etcd ({args.members} members)", ["--store", cluster.url], args.receivers, args.tensors)
        finally:
            cluster.close()


if __name__ == "__main__":
    asyncio.run(main())
