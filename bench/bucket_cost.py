"""What one bucket costs a refit beyond its bytes: the slope of refit time over bucket count, same bytes.

    python bench/bucket_cost.py [--size-mb 64] [--tensors 64] [--buckets 4 64 256 1024] [--rounds 5]
                                [--mode in_place] [--verify strict] [--metrics]

A publisher process (NIXL, xxh3 digests) and this receiver process, as ``bench/nixl_ratio.py``. The same
``--size-mb`` is refit with its direct reads cut into about ``--buckets`` buckets (``direct_bucket_bytes``),
round after round, the bucket counts interleaved; and, in the same rounds, read raw (``NixlTransport.read``
of the same byte ranges, one call per bucket, prepared once and replayed: what the transport itself costs a
bucket; and the same reads submitted with the refit's window in flight, landed in order: what it costs a bucket
when buckets overlap). Per bucket count it prints the best refit and raw seconds; then the least-squares slopes:
seconds a bucket costs a refit, a raw read (one at a time, windowed), and refitflow's own cost per bucket (refit
minus raw windowed: stages, hops, verify's per-bucket work — not the copy, not NIXL's own post and completion).
``--metrics``: the receivers report to a ``PrometheusMetrics`` each (as a server that exports metrics does), not
to the null observer. GB/s = 10^9 bytes per second.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

os.environ.setdefault("UCX_NET_DEVICES", "lo")  # a benchmark script, like the CLI, may set the environment
os.environ.setdefault("UCX_LOG_LEVEL", "error")

import anyio
import numpy as np
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests" / "transports"))

from _nixl_peer import Peer

import refitflow as rf
from refitflow.metrics.prometheus import PrometheusMetrics
from refitflow.transports.base import Read, Submitted, as_bytes
from refitflow.transports.nixl import NixlTransport


def slope(x: list[float], y: list[float]) -> float:
    return float(np.polyfit(np.asarray(x, dtype=float), np.asarray(y, dtype=float), 1)[0])


async def windowed(raw: NixlTransport, parts: list[list[Read]], k: int, window: int) -> None:
    """Every part submitted as the refit's pull does — up to ``window`` in flight, landed in order — without a
    pipeline: what the transport costs a bucket when buckets overlap."""
    flights: list[Submitted] = []
    for i, c in enumerate(parts):
        if len(flights) >= window:
            await flights.pop(0).wait()
        flights.append(await raw.submit(c, key=(k, i)))
    for f in flights:
        await f.wait()


def chunks(reads: list[Read], parts: int) -> list[list[Read]]:
    """``reads`` cut into about ``parts`` lists of equal bytes (reads split where a cut falls)."""
    total = sum(r.nbytes for r in reads)
    size = max(4096, -(-total // parts))
    out: list[list[Read]] = [[]]
    used = 0
    for r in reads:
        at = 0
        while at < r.nbytes:
            n = min(r.nbytes - at, size - used)
            out[-1].append(Read(r.peer, r.region, r.offset + at, n, r.dst[at : at + n]))
            at, used = at + n, used + n
            if used == size:
                out.append([])
                used = 0
    return [c for c in out if c]


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-mb", type=float, default=64)
    ap.add_argument("--tensors", type=int, default=64)
    ap.add_argument("--buckets", type=int, nargs="+", default=[4, 64, 256, 1024])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--mode", default="in_place")
    ap.add_argument("--verify", default="strict")
    ap.add_argument("--metrics", action="store_true", help="receivers report to PrometheusMetrics")
    a = ap.parse_args()
    numel = int(a.size_mb * 2**20 / 4 / a.tensors)
    spec = {"tensors": a.tensors, "numel": numel, "model": "bench"}
    dst = {f"layers.{i}.weight": torch.zeros(numel + i % 7) for i in range(a.tensors)}
    nbytes = sum(t.nbytes for t in dst.values())
    print(f"{a.tensors} fp32 tensors, {nbytes / 1e6:.1f} MB, mode {a.mode}, verify {a.verify}, "
          f"{'Prometheus metrics' if a.metrics else 'no metrics'}; "
          f"buckets {a.buckets}, best of {a.rounds}")  # fmt: skip
    registry, identity = rf.Registry(), rf.Identity(model="bench")
    refit_s: dict[int, list[float]] = {k: [] for k in a.buckets}
    raw_s: dict[int, list[float]] = {k: [] for k in a.buckets}
    win_s: dict[int, list[float]] = {k: [] for k in a.buckets}
    made: dict[int, int] = {}
    version = 1  # the first publication
    async with Peer(spec) as peer:
        first = await peer.publish(1, 1)
        raw = NixlTransport()
        try:
            for t in dst.values():
                raw.register(t)
            raw.connect(first.source)
            whole = [Read(first.source.agent, s.region, s.offset, s.nbytes, as_bytes(dst[s.name]))
                     for s in first.shards]  # fmt: skip
            parts = {k: chunks(whole, k) for k in a.buckets}
            receivers = {}
            for k in a.buckets:
                size = max(64, -(-nbytes // k))
                observer = {"observer": PrometheusMetrics()} if a.metrics else {}
                own = {n: torch.zeros_like(t) for n, t in dst.items()}  # a shadow receiver swaps its storages
                receivers[k] = rf.Receiver(own, registry, identity=identity, transport=NixlTransport(), mode=a.mode,
                                           verify=a.verify, direct_bucket_bytes=size, max_direct_buckets=1 << 20,
                                           receiver_id=f"rx-{k}", **observer)  # fmt: skip
            for k in a.buckets:
                await receivers[k].__aenter__()
            try:
                for rnd in range(a.rounds + 1):  # the first round prepares (plans, descriptors, wire-up)
                    for k in a.buckets:
                        for i, c in enumerate(parts[k]):
                            await raw.read(c, key=(k, i))
                        t0 = time.perf_counter()
                        for i, c in enumerate(parts[k]):
                            await raw.read(c, key=(k, i))
                        if rnd:
                            raw_s[k].append(time.perf_counter() - t0)
                        t0 = time.perf_counter()
                        await windowed(raw, parts[k], k, receivers[k].config.window_buckets)
                        if rnd:
                            win_s[k].append(time.perf_counter() - t0)
                        version += 1
                        await registry.publish(await peer.publish(version, version))
                        r = await receivers[k].refit(version)
                        made[k] = r.stages["pull"].items
                        if rnd:
                            refit_s[k].append(r.seconds)
            finally:
                for k in a.buckets:
                    await receivers[k].__aexit__(None, None, None)
        finally:
            await raw.aclose()
    print("\n| buckets (refit) | reads (raw) | refit best s | raw best s | raw windowed best s | refit GB/s |\n"
          "|---:|---:|---:|---:|---:|---:|")  # fmt: skip
    for k in a.buckets:
        print(f"| {made[k]} | {len(parts[k])} | {min(refit_s[k]):.4f} | {min(raw_s[k]):.4f} | {min(win_s[k]):.4f} "
              f"| {nbytes / min(refit_s[k]) / 1e9:.2f} |")  # fmt: skip
    ks = [made[k] for k in a.buckets]
    per_refit = slope(ks, [min(refit_s[k]) for k in a.buckets])
    per_raw = slope([len(parts[k]) for k in a.buckets], [min(raw_s[k]) for k in a.buckets])
    per_win = slope([len(parts[k]) for k in a.buckets], [min(win_s[k]) for k in a.buckets])
    print(f"\nper bucket: refit {per_refit * 1e6:.0f} us; raw reads one at a time {per_raw * 1e6:.0f} us, "
          f"windowed {per_win * 1e6:.0f} us; refitflow's own {(per_refit - per_win) * 1e6:.0f} us (refit - raw "
          f"windowed: slopes of the best times over bucket count)")  # fmt: skip


if __name__ == "__main__":
    anyio.run(main)
