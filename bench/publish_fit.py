"""The trainer's side per tensor: fit time = N·c + bytes/BW of a warm ``publish()`` over 10 … 10,000 tensors.

    python bench/publish_fit.py [--sizes-mb 40 160] [--tensors 10 100 1000 10000] [--versions 4]

One process, ``LoopbackTransport`` (registration is free there) and an in-process ``rf.Registry``, fp32
tensors of equal size, xxh3 digests: what ``publish()`` costs a trainer rank — every shard's spec,
digests and the announcement — before any receiver reads. Each point is the best of ``--versions``
warm publishes (the tensors change before each, untimed).
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(ROOT))

import anyio  # noqa: E402
import torch  # noqa: E402

import refitflow as rf  # noqa: E402
from bench.loopback_fit import fit  # noqa: E402


async def point(size_mb: float, n: int, versions: int) -> float:
    numel = int(size_mb * 2**20 / 4 / n)
    src = {f"layers.{i}.weight": torch.randn(numel) for i in range(n)}
    best = float("inf")
    async with rf.Publisher(rf.Registry(), identity=rf.Identity(model="bench")) as pub:
        for v in range(1, versions + 2):
            for t in src.values():
                t.add_(1.0)
            t0 = time.perf_counter()
            await pub.publish(v, src)
            if v > 1:
                best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes-mb", type=float, nargs="+", default=[40, 160])
    ap.add_argument("--tensors", type=int, nargs="+", default=[10, 100, 1000, 10000])
    ap.add_argument("--versions", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for size in args.sizes_mb:
        for n in args.tensors:
            seconds = anyio.run(point, size, n, args.versions)
            nbytes = int(size * 2**20 / 4 / n) * 4 * n
            rows.append((n, nbytes, seconds))
            print(f"  {size:5.0f} MiB {n:6d} tensors: publish {seconds * 1e3:7.1f} ms", flush=True)
    c, inv_bw = fit(rows)
    print(f"fit: c = {c * 1e6:.1f} µs per tensor, BW = {1 / inv_bw / 1e9:.2f} GB/s (digests and announcement)")


if __name__ == "__main__":
    main()
