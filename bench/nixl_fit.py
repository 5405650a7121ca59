"""Per-tensor overhead of a NIXL refit: fit time = N·c + bytes/BW over runs of ``nixl_bench.py``.

    python bench/nixl_fit.py [--sizes-mb 128 512] [--tensors 10 100 1000]

Each point is the best warm refit (plan cached) of one ``nixl_bench.py`` run, in a fresh process;
the same fit of that run's raw NIXL READ of the same bytes (every tensor one descriptor, replayed) shows
what NIXL itself costs per tensor, and the difference what refitflow adds.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import subprocess
import sys

import numpy as np

BENCH = pathlib.Path(__file__).with_name("nixl_bench.py")
LINE = re.compile(r"refit v(\d+):\s+([\d.]+) GB/s in\s+([\d.]+) ms")
RAW = re.compile(r"raw NIXL READ, replayed \(best of 5\):\s+([\d.]+) GB/s")


def best_warm_ms(size_mb: float, tensors: int) -> tuple[float, float]:
    """(best warm refit ms, best replayed raw READ ms) of one run."""
    out = subprocess.run(
        [sys.executable, str(BENCH), "--size-mb", str(size_mb), "--tensors", str(tensors), "--versions", "4"],
        capture_output=True, text=True, timeout=900, check=True,
    ).stdout  # fmt: skip
    nbytes = sum(4 * (int(size_mb * 2**20 / 4 / tensors) + i % 7) for i in range(tensors))
    raw_ms = nbytes / float(RAW.findall(out)[0]) / 1e6
    return min(float(ms) for v, _, ms in LINE.findall(out) if int(v) > 1), raw_ms


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes-mb", type=float, nargs="+", default=[128, 512])
    ap.add_argument("--tensors", type=int, nargs="+", default=[10, 100, 1000])
    args = ap.parse_args()
    rows, raws = [], []
    for size in args.sizes_mb:
        for n in args.tensors:
            ms, raw_ms = best_warm_ms(size, n)
            rows.append((n, size * 2**20, ms / 1e3))
            raws.append((n, size * 2**20, raw_ms / 1e3))
            print(f"{size:6.0f} MiB {n:5d} tensors: refit {ms:8.1f} ms, raw NIXL READ {raw_ms:8.1f} ms")
    for label, pts in (("refit", rows), ("raw NIXL READ", raws)):
        a = np.array([[n, b] for n, b, _ in pts])
        t = np.array([s for _, _, s in pts])
        (c, inv_bw), *_ = np.linalg.lstsq(a, t, rcond=None)
        print(f"{label}: fit time = N·c + bytes/BW: c = {c * 1e6:.1f} µs per tensor, BW = {1 / inv_bw / 1e9:.2f} GB/s")


if __name__ == "__main__":
    main()
