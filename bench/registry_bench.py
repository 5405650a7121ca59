"""Registry discovery bench: SOURCES sources × TENSORS tensors, CLIENTS concurrent clients.

    PYTHONPATH=src python bench/registry_bench.py [--sources 1000] [--tensors 1000] [--world 8]
                                                  [--clients 200] [--queries 20]

The registry runs in its own process (``refitflow registry``); sources are grouped WORLD ranks to a
version of one model (SOURCES / WORLD models), every tensor sharded along axis 0 across the ranks.
Each client discovers random models: the first query of a version fetches its manifests ("cold"),
later ones are one round trip answered from the client's cache ("warm"). Prints p50/p99 latencies.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from typing import Any

import torch
import zmq.asyncio

import refitflow as rf
from refitflow.api.digesting import digest
from refitflow.core.types import Manifest, ShardSpec, SourceAddress
from refitflow.core.wire import PROTOCOL_VERSION, manifest_to_dict
from refitflow.registry.client.client import RegistryClient


async def spawn_registry(*flags: str, **options: Any) -> tuple[asyncio.subprocess.Process, str]:
    """``refitflow registry`` on a free loopback port (lease 600 s unless ``flags`` say otherwise), open (no
    CURVE: these benches measure the protocol, as docs' figures were), unless ``flags`` choose keys; its address."""
    if not {"--open", "--keys", "--curve-secret"} & set(flags):
        flags = (*flags, "--open")
    code = "import sys; from refitflow.cli.registry_cmd import registry_main; sys.exit(registry_main(sys.argv[1:]))"
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", code, "--bind", "tcp://127.0.0.1:*",
                                                "--lease-s", "600", *flags, stdout=asyncio.subprocess.PIPE,
                                                **options)  # fmt: skip
    assert proc.stdout is not None
    line = (await proc.stdout.readline()).decode()
    return proc, line.split(" serving at ")[1].split()[0]


def rank_templates(world: int, tensors: int) -> list[dict[str, Any]]:
    """Each rank's manifest as the wire carries it (real ``ShardSpec``s, the publisher's digest fields of a
    4 × 64 bf16 slice), built once: building 10^6 specs per run would time this script, not the registry."""
    fields = digest(torch.zeros(4, 64, dtype=torch.bfloat16))
    out = []
    for rank in range(world):
        shape, rows = (4 * world, 64), (4 * rank, 4 * rank + 4)
        shards = tuple(ShardSpec(name=f"layers.{t}.weight", dtype="bfloat16", global_shape=shape, axis=0,
                                 start=rows[0], stop=rows[1], region=t, **fields) for t in range(tensors))  # fmt: skip
        source = SourceAddress(transport="nixl", agent=f"r{rank}")
        out.append(manifest_to_dict(Manifest(identity=rf.Identity(model="template"), version=1, rank=rank,
                                             world_size=world, source=source, shards=shards)))  # fmt: skip
    return out


def manifest_dict(template: dict[str, Any], model: int, rank: int) -> dict[str, Any]:
    """A rank's template as model ``model``'s manifest (its own identity and source agent)."""
    return template | {"identity": template["identity"] | {"model": f"model-{model}"},
                       "source": template["source"] | {"agent": f"m{model}r{rank}"}}  # fmt: skip


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[q - 1] * 1e3 if len(values) > 1 else values[0] * 1e3


async def main(args: argparse.Namespace) -> None:
    models = args.sources // args.world
    registry, address = await spawn_registry()
    ctx = zmq.asyncio.Context()
    try:
        templates = rank_templates(args.world, args.tensors)
        t0 = time.perf_counter()
        async with RegistryClient(address, context=ctx, request_timeout_s=60) as publisher:
            sem = asyncio.Semaphore(16)

            async def publish(model: int, rank: int) -> None:
                async with sem:  # the publish op of RegistryClient, with the manifest already a dict
                    await publisher._request("publish", manifest=manifest_dict(templates[rank], model, rank),
                                             owner=publisher.client_id)  # fmt: skip

            await asyncio.gather(*(publish(m, r) for m in range(models) for r in range(args.world)))
            published = time.perf_counter() - t0
            print(f"published {models * args.world} sources × {args.tensors} tensors in {published:.1f} s "
                  f"({models * args.world / published:.0f} manifests/s), protocol v{PROTOCOL_VERSION}")  # fmt: skip
            cold: list[float] = []
            warm: list[float] = []
            warm_start: list[float] = []
            async with RegistryClient(address, context=ctx, request_timeout_s=60) as alone:
                t = time.perf_counter()
                await alone.latest(rf.Identity(model="model-0"))
                print(f"one client alone, cold discovery: {(time.perf_counter() - t) * 1e3:.1f} ms")

            async def client(i: int) -> None:
                rng = random.Random(i)
                async with RegistryClient(address, context=ctx, request_timeout_s=120) as c:
                    identity = rf.Identity(model=f"model-{rng.randrange(models)}")
                    t = time.perf_counter()
                    pub = await c.latest(identity)
                    cold.append(time.perf_counter() - t)
                    assert pub is not None and len(pub.manifests) == args.world
                    await barrier.wait()  # warm queries start once every client is past its cold one
                    warm_start.append(time.perf_counter())
                    for _ in range(args.queries):
                        t = time.perf_counter()
                        assert await c.latest(identity) is pub
                        warm.append(time.perf_counter() - t)

            barrier = asyncio.Barrier(args.clients)
            t1 = time.perf_counter()
            await asyncio.gather(*(client(i) for i in range(args.clients)))
            took = time.perf_counter() - t1
            warm_s = time.perf_counter() - min(warm_start)
        shards = args.world * args.tensors
        print(f"{args.clients} concurrent clients, {took:.1f} s:")
        print(
            f"  cold discovery (fetch {args.world} manifests, {shards} shards): "
            f"p50 {pct(cold, 50):.1f} ms  p99 {pct(cold, 99):.1f} ms"
        )
        print(f"  warm discovery (cached, one round trip): p50 {pct(warm, 50):.2f} ms  p99 {pct(warm, 99):.2f} ms  "
              f"({len(warm) / warm_s:.0f} queries/s)")  # fmt: skip
    finally:
        ctx.term()
        registry.terminate()
        await registry.wait()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sources", type=int, default=1000)
    parser.add_argument("--tensors", type=int, default=1000)
    parser.add_argument("--world", type=int, default=8, help="ranks (sources) per model version")
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--queries", type=int, default=20, help="warm queries per client after the first")
    asyncio.run(main(parser.parse_args()))
