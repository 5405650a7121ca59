"""Child processes for the cross-process registry tests: ``python _children.py ROLE ADDRESS``.

Each prints one JSON line per event on stdout (flushed) for the test to read.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import torch

import refitflow as rf
from refitflow.registry.client.client import RegistryClient

IDENTITY = rf.Identity(model="tiny-cross-process")


def say(**event: object) -> None:
    print(json.dumps(event), flush=True)


async def publisher(address: str) -> None:
    """Two ranks (world 2) publish halves of one tensor, then stay alive heartbeating."""
    full = torch.arange(8 * 3, dtype=torch.float32).reshape(8, 3)
    async with RegistryClient(address, request_timeout_s=2) as client:
        pubs = [rf.Publisher(client, identity=IDENTITY, rank=r, world_size=2, metadata={"run": "t"}) for r in (0, 1)]
        for rank, pub in enumerate(pubs):
            await pub.__aenter__()
            half = full[4 * rank : 4 * rank + 4].contiguous()
            await pub.publish(1, {"w": rf.Sharded(tensor=half, axis=0, start=4 * rank, global_shape=(8, 3))})
        say(event="published", version=1)
        await asyncio.Event().wait()


async def receiver(address: str) -> None:
    """Discover the complete version, describe it, then wait until it is no longer offered."""
    async with RegistryClient(address, request_timeout_s=2, requery_s=0.2) as client:
        await client.register_receiver(IDENTITY, f"rx-{id(client)}")
        pub = await client.wait_complete(IDENTITY, 1, 20, metadata={"run": "t"})
        ranges = sorted((s.start, s.stop) for m in pub.manifests for s in m.shards)
        say(event="discovered", version=pub.version, ranks=[m.rank for m in pub.manifests], ranges=ranges,
            fetches=client.fetches)  # fmt: skip
        while await client.latest(IDENTITY, 1) is not None:  # noqa: ASYNC110 (withdrawals are not announced)
            await asyncio.sleep(0.05)
        say(event="gone", t=time.monotonic(), fetches=client.fetches)


if __name__ == "__main__":
    role, address = sys.argv[1], sys.argv[2]
    asyncio.run({"publisher": publisher, "receiver": receiver}[role](address))
