"""What a relay reader's prepared transfers hold as its relay changes from version to version.

    python bench/prepared_memory.py [--relays 8] [--buckets 64] [--descs 1000] [--versions 16] [--unbounded]

One reader (``NixlTransport``) reads the same plan — ``--buckets`` keys of ``--descs`` scattered 1 KiB ranges
each — every version from another of ``--relays`` peers (as a chain formed in join order reshuffles), real UCX
READs in this process. A line a version: the transfers prepared so far (a transfer: one stripe of a key, one a
NIXL agent), those kept for replay, the time spent describing and preparing this version's reads, and this
process's RSS growth since the first version. ``--unbounded`` keeps every peer's preparations (the code before
``PEERS``: a reader held a plan's descriptors once a relay it ever read) — run both for the before and after.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("UCX_NET_DEVICES", "lo")  # a benchmark script, like the CLI, may set the environment

import anyio
import torch

from refitflow.transports import _nixl_prepared
from refitflow.transports.base import Read
from refitflow.transports.nixl import NixlTransport

STEP, SIZE = 4096, 1024  # a range every 4 KiB, 1 KiB long: none coalesce


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6


async def run(relays: int, buckets: int, descs: int, versions: int) -> None:
    span = buckets * descs * STEP
    owners = [NixlTransport() for _ in range(relays)]
    reader = NixlTransport()
    try:
        srcs = [torch.full((span,), i + 1, dtype=torch.uint8) for i in range(relays)]
        regions = [o.register(s) for o, s in zip(owners, srcs, strict=True)]
        dst = torch.zeros(span, dtype=torch.uint8)
        reader.register(dst)
        for o in owners:
            reader.connect(o.address())
        base = None
        print("version  relay  prepared  kept  prep+describe ms  RSS growth MB")
        for v in range(versions):
            i, prep0 = v % relays, reader.prep_seconds
            for b in range(buckets):
                offs = [(b * descs + d) * STEP for d in range(descs)]
                reads = [Read(owners[i].agent, regions[i], o, SIZE, dst[o : o + SIZE]) for o in offs]
                with anyio.fail_after(60):
                    await reader.read(reads, key=("plan", b))
            assert bool((dst[:SIZE] == i + 1).all()) and bool((dst[span - STEP : span - STEP + SIZE] == i + 1).all())
            base = rss_mb() if base is None else base
            print(f"{v + 1:7d}  {i:5d}  {reader.prepared:8d}  {reader.kept:4d}  "
                  f"{(reader.prep_seconds - prep0) * 1e3:16.1f}  "
                  f"{rss_mb() - base:13.1f}")  # fmt: skip
    finally:
        await reader.aclose()
        for o in owners:
            await o.aclose()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--relays", type=int, default=8)
    p.add_argument("--buckets", type=int, default=64)
    p.add_argument("--descs", type=int, default=1000)
    p.add_argument("--versions", type=int, default=16)
    p.add_argument("--unbounded", action="store_true", help="keep every peer's preparations (the code before PEERS)")
    a = p.parse_args()
    if a.unbounded:
        _nixl_prepared.PEERS = 1 << 30
    anyio.run(run, a.relays, a.buckets, a.descs, a.versions)


if __name__ == "__main__":
    main()
