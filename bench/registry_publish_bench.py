"""Registry publish cost against ranks and versions held (the embedded store: no sockets, no JSON).

    PYTHONPATH=src python bench/registry_publish_bench.py [--tensors 1000] [--ranks 1 8 64] [--held 0 500]

For each world size, publishes ``repeat`` versions (every rank's manifest, each tensor sharded along
axis 0) on a store that already holds ``held`` complete versions a registered receiver has not
reported (so none can be dropped), and prints the mean time per manifest of the best version. Flat
rows and columns: the cost does not grow with ranks or with versions held.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import time

import refitflow as rf
from refitflow.registry.service.store import RegistryStore

ID = rf.Identity(model="bench")


def manifests(version: int, world: int, tensors: int) -> list[rf.Manifest]:
    out = []
    for rank in range(world):
        shards = tuple(
            rf.ShardSpec(name=f"layers.{t}.weight", dtype="bfloat16", global_shape=(4 * world, 64), axis=0,
                         start=4 * rank, stop=4 * rank + 4, digest=f"{t:016x}", region=t)
            for t in range(tensors)
        )  # fmt: skip
        out.append(rf.Manifest(identity=ID, version=version, rank=rank, world_size=world, shards=shards,
                               source=rf.SourceAddress(transport="nixl", agent=f"r{rank}")))  # fmt: skip
    return out


async def one(world: int, held: int, tensors: int, repeat: int) -> float:
    """Best of ``repeat`` versions: mean seconds per manifest."""
    store = RegistryStore()
    await store.register_receiver(ID, "slow")
    small = manifests(0, 1, 1)[0]
    for version in range(1, held + 1):  # complete, unreleased versions of one small tensor
        await store.publish(rf.Manifest(identity=ID, version=version, rank=0, world_size=1, shards=small.shards,
                                        source=small.source))  # fmt: skip
    best = float("inf")
    for version in range(held + 1, held + 1 + repeat):
        batch = manifests(version, world, tensors)
        gc.collect()
        gc.disable()  # the store's cost, not the collector's pauses over everything the bench built
        t = time.perf_counter()
        for m in batch:
            await store.publish(m)
        best = min(best, (time.perf_counter() - t) / world)
        gc.enable()
    return best


async def main(args: argparse.Namespace) -> None:
    print(f"{args.tensors} tensors per manifest; mean ms per published manifest")
    print("ranks | " + " | ".join(f"{h} versions held" for h in args.held))
    for world in args.ranks:
        row = [await one(world, h, args.tensors, args.repeat) * 1e3 for h in args.held]
        print(f"{world:5d} | " + " | ".join(f"{ms:.2f}" for ms in row))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tensors", type=int, default=1000)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--held", type=int, nargs="+", default=[0, 500])
    parser.add_argument("--repeat", type=int, default=5, help="versions published per cell (best one counts)")
    asyncio.run(main(parser.parse_args()))
