"""Loopback refit GB/s vs a plain ``copy_`` of the same bytes, in one run.

    python bench/loopback_bench.py [--size-mb 512] [--tensors 100] [--budget-mb 64]

Direct landing (same dtype) and staged (bf16 -> fp32 cast) refits, in_place and shadow.
GB/s = 10^9 bytes per second.
"""

from __future__ import annotations

import argparse
import time

import anyio
import torch

import refitflow as rf


def copy_gbps(src: dict[str, torch.Tensor], dst: dict[str, torch.Tensor]) -> float:
    best = 0.0
    for _ in range(3):
        t0 = time.perf_counter()
        for n, t in src.items():
            dst[n].copy_(t)
        best = max(best, sum(t.nbytes for t in src.values()) / (time.perf_counter() - t0) / 1e9)
    return best


async def refit_gbps(src: dict, dst: dict, mode: str, budget: int, versions: int = 3) -> tuple[float, rf.RefitResult]:
    registry, ident = rf.Registry(), rf.Identity(model="bench")
    best, last = 0.0, None
    async with (
        rf.Publisher(registry, identity=ident) as pub,
        rf.Receiver(dst, registry, identity=ident, mode=mode, budget_bytes=budget) as recv,
    ):
        for v in range(1, versions + 1):
            await pub.publish(v, src)
            last = await recv.refit(v)
            await pub.released(v, timeout=60)
            best = max(best, last.gbps)
    assert last is not None
    return best, last


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-mb", type=float, default=512)
    ap.add_argument("--tensors", type=int, default=100)
    ap.add_argument("--budget-mb", type=float, default=64)
    args = ap.parse_args()
    n = args.tensors
    per = int(args.size_mb * 1e6 / n / 4)
    src32 = {f"t{i}": torch.randn(per) for i in range(n)}
    src16 = {k: v.to(torch.bfloat16) for k, v in src32.items()}
    dst = {k: torch.zeros_like(v) for k, v in src32.items()}
    budget = int(args.budget_mb * 2**20)
    print(f"{n} tensors, {sum(t.nbytes for t in src32.values()) / 1e6:.0f} MB fp32, budget {args.budget_mb} MiB")
    print(f"{'path':<34} {'GB/s':>6} {'x copy_':>8}")
    ref = copy_gbps(src32, dst)
    print(f"{'copy_ fp32 -> fp32 (reference)':<34} {ref:6.2f} {1.0:8.2f}")
    for mode in ("in_place", "shadow"):
        gbps, _ = await refit_gbps(src32, dst, mode, budget)
        print(f"{'refit direct ' + mode:<34} {gbps:6.2f} {gbps / ref:8.2f}")
    cast_ref = copy_gbps(src16, dst)
    print(f"{'copy_ bf16 -> fp32 (reference)':<34} {cast_ref:6.2f} {cast_ref / ref:8.2f}")
    for mode in ("in_place", "shadow"):
        gbps, r = await refit_gbps(src16, dst, mode, budget)
        print(f"{'refit staged bf16->fp32 ' + mode:<34} {gbps:6.2f} {gbps / ref:8.2f}  peak staging "
              f"{r.peak_staging_bytes / 2**20:.1f} MiB")  # fmt: skip
    stages = ", ".join(f"{k} {v.seconds * 1e3:.0f} ms" for k, v in r.stages.items())
    print(f"last staged refit, per-stage busy time: {stages}")


if __name__ == "__main__":
    anyio.run(main)
