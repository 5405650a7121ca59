"""Per-tensor overhead of a warm loopback refit: fit time = N·c + bytes/BW over 10 … 10,000 tensors.

    python bench/loopback_fit.py [--sizes-mb 40 160] [--tensors 10 100 1000 10000] [--mode in_place]

One process, ``LoopbackTransport``, fp32 tensors of equal size, strict verify (xxh3), plan cached.
Each point is the best of ``--versions`` warm refits (wall seconds) and their process CPU seconds
(both threads; robust when the machine is shared). Also prints the first refit's plan seconds.
"""

from __future__ import annotations

import argparse
import time

import anyio
import numpy as np
import torch

import refitflow as rf


async def point(size_mb: float, n: int, mode: str, versions: int) -> tuple[float, float, float, rf.RefitResult]:
    numel = int(size_mb * 2**20 / 4 / n)
    src = {f"layers.{i}.weight": torch.randn(numel) for i in range(n)}
    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    registry, ident = rf.Registry(), rf.Identity(model="bench")
    best = (float("inf"), float("inf"))
    first_plan = 0.0
    last = None
    async with (
        rf.Publisher(registry, identity=ident) as pub,
        rf.Receiver(dst, registry, identity=ident, mode=mode, budget_bytes=64 << 20) as recv,
    ):
        for v in range(1, versions + 2):
            await pub.publish(v, src)
            c0, t0 = time.process_time(), time.perf_counter()
            last = await recv.refit(v)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            if v == 1:
                first_plan = last.stages["plan"].seconds
            else:
                best = min(best, (wall, cpu))
            await pub.released(v, timeout=60)
    assert last is not None
    return best[0], best[1], first_plan, last


def fit(rows: list[tuple[int, int, float]]) -> tuple[float, float]:
    a = np.array([[n, b] for n, b, _ in rows], dtype=float)
    t = np.array([s for _, _, s in rows])
    (c, inv_bw), *_ = np.linalg.lstsq(a, t, rcond=None)
    return c, inv_bw


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes-mb", type=float, nargs="+", default=[40, 160])
    ap.add_argument("--tensors", type=int, nargs="+", default=[10, 100, 1000, 10000])
    ap.add_argument("--mode", default="in_place")
    ap.add_argument("--versions", type=int, default=4)
    args = ap.parse_args()
    walls, cpus = [], []
    for size in args.sizes_mb:
        for n in args.tensors:
            wall, cpu, plan_s, r = anyio.run(point, size, n, args.mode, args.versions)
            walls.append((n, int(size * 2**20), wall))
            cpus.append((n, int(size * 2**20), cpu))
            stages = ", ".join(f"{k} {v.seconds * 1e3:.1f}" for k, v in r.stages.items())
            print(f"{size:5.0f} MiB {n:6d} tensors: warm {wall * 1e3:8.1f} ms wall, {cpu * 1e3:8.1f} ms CPU; "
                  f"first plan {plan_s * 1e3:6.1f} ms; stages (ms busy) {stages}")  # fmt: skip
    for label, rows in (("wall", walls), ("CPU", cpus)):
        c, inv_bw = fit(rows)
        print(f"fit {label}: c = {c * 1e6:.2f} µs per tensor, BW = {1 / inv_bw / 1e9:.2f} GB/s")


if __name__ == "__main__":
    main()
