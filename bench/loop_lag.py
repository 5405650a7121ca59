"""Event-loop lag while a refit runs: a task ticking every 1 ms records how late each tick is.

python bench/loop_lag.py [--size-mb 512] [--tensors 1000] [--transport loopback]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import anyio
import torch

import refitflow as rf


async def ticker(lags: list[float], stop: anyio.Event) -> None:
    while not stop.is_set():
        t0 = time.perf_counter()
        await anyio.sleep(0.001)
        lags.append(time.perf_counter() - t0 - 0.001)


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-mb", type=float, default=512)
    ap.add_argument("--tensors", type=int, default=1000)
    ap.add_argument("--transport", default="loopback")
    ap.add_argument("--cast", action="store_true", help="bf16 -> fp32 (staged) instead of direct")
    ap.add_argument("--gc-freeze", action="store_true", help="gc.freeze() once the model is loaded, as a server would")
    args = ap.parse_args()
    per = int(args.size_mb * 1e6 / args.tensors / 4)
    src = {f"t{i}": torch.randn(per) for i in range(args.tensors)}
    if args.cast:
        src = {k: v.to(torch.bfloat16) for k, v in src.items()}
    dst = {k: torch.zeros(per) for k in src}
    registry, ident = rf.Registry(), rf.Identity(model="lag")
    if args.gc_freeze:
        gc.freeze()  # the collector's full passes (the whole heap, GIL held) are the process's, not refitflow's
    async with (
        rf.Publisher(registry, identity=ident, transport=args.transport) as pub,
        rf.Receiver(dst, registry, identity=ident, transport=args.transport, budget_bytes=64 << 20) as recv,
    ):
        for v in (1, 2):
            if v > 1:  # new bytes: a version of the same bytes would be a delta refit that reads nothing
                for t in src.values():
                    t.add_(1)
            await pub.publish(v, src)
            lags: list[float] = []
            stop = anyio.Event()
            async with anyio.create_task_group() as tg:
                tg.start_soon(ticker, lags, stop)
                result = await recv.refit(v)
                stop.set()
            lags.sort()
            p99 = lags[int(0.99 * (len(lags) - 1))]
            p50 = statistics.median(lags)
            print(f"refit {v}: {result.gbps:.2f} GB/s, plan {result.stages['plan'].seconds:.2f} s busy, "
                  f"{len(lags)} ticks, loop lag p50 {p50 * 1e3:.2f} ms, "
                  f"p99 {p99 * 1e3:.2f} ms, max {lags[-1] * 1e3:.2f} ms")  # fmt: skip
            await pub.released(v, timeout=30)


if __name__ == "__main__":
    anyio.run(main)
