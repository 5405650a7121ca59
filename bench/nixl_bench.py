"""NIXL refit GB/s vs raw NIXL READ vs one-thread memcpy, publisher in another process, one run.

    python bench/nixl_bench.py [--size-mb 256] [--tensors 100] [--agents 1]   # --tensors 10 / 1000

Prints: one-thread ``copy_`` GB/s; raw NIXL READ GB/s of the same bytes (every tensor one read, one
``NixlTransport.read`` call, prepared once, then replayed); end-to-end refit GB/s per version (a
``Receiver`` over NIXL, plan and descriptors cached after the first); each refit's control
overhead (discover + plan stage seconds + descriptor preparation) and the p99 lag of a task
ticking every 1 ms on the event loop during the refit. GB/s = 10^9 bytes per second.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import time

os.environ.setdefault("UCX_NET_DEVICES", "lo")  # a benchmark script, like the CLI, may set the environment

import anyio
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests" / "transports"))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from _nixl_peer import Peer

import refitflow as rf
from bench.baselines import memcpy_gbps
from refitflow.transports.base import Read, as_bytes
from refitflow.transports.nixl import NixlTransport


async def raw_read_gbps(manifest: rf.Manifest, dst: dict[str, torch.Tensor], agents: int) -> tuple[float, float]:
    """(first READ incl. preparation and wire-up, best replay) GB/s of every tensor in one read call."""
    tr = NixlTransport(num_agents=agents)
    try:
        for t in dst.values():
            tr.register(t)
        tr.connect(manifest.source)
        reads = [
            Read(manifest.source.agent, s.region, s.offset, s.nbytes, as_bytes(dst[s.name])) for s in manifest.shards
        ]
        nbytes, times = sum(r.nbytes for r in reads), []
        for _ in range(6):
            t0 = time.perf_counter()
            await tr.read(reads, key="all")
            times.append(time.perf_counter() - t0)
        return nbytes / times[0] / 1e9, nbytes / min(times[1:]) / 1e9
    finally:
        await tr.aclose()


async def refit_with_lag(recv: rf.Receiver, version: int) -> tuple[rf.RefitResult, float]:
    lags: list[float] = []
    done = anyio.Event()

    async def tick() -> None:
        while not done.is_set():
            t0 = time.perf_counter()
            await anyio.sleep(0.001)
            lags.append(time.perf_counter() - t0 - 0.001)

    async with anyio.create_task_group() as tg:
        tg.start_soon(tick)
        result = await recv.refit(version)
        done.set()
    p99 = statistics.quantiles(lags, n=100)[98] if len(lags) >= 2 else float("nan")
    return result, p99


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-mb", type=float, default=256, help="model size in MiB")
    ap.add_argument("--tensors", type=int, default=100)
    ap.add_argument("--versions", type=int, default=3)
    ap.add_argument("--agents", type=int, default=1, help="receiver agents to stripe reads over")
    args = ap.parse_args()
    numel = int(args.size_mb * 2**20 / 4 / args.tensors)
    spec = {"tensors": args.tensors, "numel": numel, "model": "bench"}
    dst = {f"layers.{i}.weight": torch.zeros(numel + i % 7) for i in range(args.tensors)}
    nbytes = sum(t.nbytes for t in dst.values())
    print(
        f"{args.tensors} fp32 tensors, {nbytes / 2**20:.0f} MiB; publisher in another process; "
        f"receiver agents {args.agents}; GB/s = 1e9 B/s"
    )
    print(f"one-thread memcpy (torch copy_, 1 thread):  {memcpy_gbps(nbytes):6.2f} GB/s")
    registry, identity = rf.Registry(), rf.Identity(model="bench")
    async with Peer(spec) as peer:
        first = await peer.publish(1, 1)
        cold, warm = await raw_read_gbps(first, dst, args.agents)
        print(f"raw NIXL READ, first (prep + wire-up):      {cold:6.2f} GB/s")
        print(f"raw NIXL READ, replayed (best of 5):        {warm:6.2f} GB/s")
        transport = NixlTransport(num_agents=args.agents)
        async with rf.Receiver(dst, registry, identity=identity, transport=transport) as recv:
            await registry.publish(first)
            for version in range(1, args.versions + 1):
                if version > 1:
                    await registry.publish(await peer.publish(version, version))
                prep0 = transport.prep_seconds
                result, p99 = await refit_with_lag(recv, version)
                prep = transport.prep_seconds - prep0
                st = result.stages
                control = st["discover"].seconds + st["plan"].seconds + prep
                print(
                    f"refit v{version}: {result.gbps:6.2f} GB/s in {result.seconds * 1e3:7.1f} ms; "
                    f"plan_cached={result.plan_cached}; control {control * 1e3:6.2f} ms "
                    f"(discover {st['discover'].seconds * 1e3:.2f}, plan {st['plan'].seconds * 1e3:.2f}, "
                    f"descriptor prep {prep * 1e3:.2f}); pull {st['pull'].seconds * 1e3:.1f} ms, "
                    f"verify {st['verify'].seconds * 1e3:.1f} ms; loop lag p99 {p99 * 1e3:.2f} ms"
                )


if __name__ == "__main__":
    anyio.run(main)
