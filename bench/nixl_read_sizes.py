"""Back-to-back NIXL READs of one size through ``NixlTransport.read``: what each read costs beyond its copy.

    python bench/nixl_read_sizes.py [--total-mb 256] [--sizes-mb 64 4 1] [--rounds 3]

Two agents in this process (UCX cma, as between processes), ``--total-mb`` read as consecutive reads of
each size, one after the other (each awaited, as the pipeline's pull stage awaits a bucket), each posted
with the served-bytes notification as a refit's reads are. Prints the best of ``--rounds`` per size: GB/s
and milliseconds per read. Small reads (relay buckets are 4 MiB, delta refits read pieces) show the fixed
cost of one read: the hop to a worker thread, NIXL's post, and the wait for a read that comes back pending.
GB/s = 10^9 bytes per second.
"""

from __future__ import annotations

import argparse
import logging
import os
import time

os.environ.setdefault("UCX_NET_DEVICES", "lo")  # a benchmark script, like the CLI, may set the environment
os.environ.setdefault("UCX_LOG_LEVEL", "error")

import anyio
import torch

from refitflow.transports.base import Read
from refitflow.transports.nixl import NixlTransport


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--total-mb", type=int, default=256, help="MiB read per round")
    ap.add_argument("--sizes-mb", type=float, nargs="+", default=[64, 4, 1], help="read sizes, MiB")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    logging.getLogger("nixl").setLevel(logging.WARNING)
    torch.set_num_threads(1)
    total = a.total_mb << 20
    owner, reader = NixlTransport(), NixlTransport()
    src = torch.randint(0, 255, (total,), dtype=torch.uint8)
    dst = torch.zeros(total, dtype=torch.uint8)
    region = owner.register(src)
    reader.register(dst)
    reader.connect(owner.address())
    try:
        print(f"{a.total_mb} MiB per round as back-to-back reads, best of {a.rounds}")
        for size_mb in a.sizes_mb:
            size = int(size_mb * (1 << 20))
            starts = range(0, total - size + 1, size)
            best = float("inf")
            for _ in range(a.rounds):
                t0 = time.perf_counter()
                for i, at in enumerate(starts):
                    await reader.read([Read(owner.agent, region, at, size, dst[at : at + size])], key=(size, i))
                best = min(best, time.perf_counter() - t0)
            print(f"reads of {size_mb:6.2f} MiB: {len(starts) * size / best / 1e9:6.2f} GB/s, "
                  f"{best / len(starts) * 1e3:6.3f} ms per read")  # fmt: skip
        if not torch.equal(src, dst):
            raise SystemExit("the bytes read differ from the source")
    finally:
        await reader.aclose()
        await owner.aclose()


if __name__ == "__main__":
    anyio.run(main)
