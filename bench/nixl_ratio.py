"""Refit vs raw NIXL READ of the same bytes, interleaved in one run (fair on a shared machine).

    python bench/nixl_ratio.py [--size-mb 512] [--tensors 174] [--rounds 6] [--agents 1] [--mode in_place]
                               [--direct-bucket-mb 64] [--diagnose-no-hashing]

A publisher process (NIXL, xxh3 digests) and this receiver process. Each round publishes a new version, then
one raw READ of every shard into the destination (one ``NixlTransport.read``, prepared once, replayed) and one
strict-verify refit of it, the raw READ first in even rounds and the refit first in odd ones (what follows a
publish — the trainer's frees, the registry taking the records — falls on each alike); both with ``--agents``
receiver agents (reads striped over them). Prints each
pair and the ratio of the medians and of the bests. GB/s = 10^9 bytes per second.

``--diagnose-no-hashing`` is a diagnostic, not a mode: it replaces verify's hashing of whole units with
nothing in this process, so the refit checks no byte — it shows what verifying costs beside the copies.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import time

os.environ.setdefault("UCX_NET_DEVICES", "lo")  # a benchmark script, like the CLI, may set the environment
os.environ.setdefault("UCX_LOG_LEVEL", "error")

import anyio
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests" / "transports"))

from _nixl_peer import Peer

import refitflow as rf
from refitflow.transports.base import Read, as_bytes
from refitflow.transports.nixl import NixlTransport


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-mb", type=float, default=512)
    ap.add_argument("--tensors", type=int, default=174)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--agents", type=int, default=1)
    ap.add_argument("--mode", default="in_place")
    ap.add_argument("--direct-bucket-mb", type=float, default=64, help="ReceiverConfig.direct_bucket_bytes, MiB")
    ap.add_argument("--diagnose-no-hashing", action="store_true", help="verify hashes nothing (unverified refits)")
    a = ap.parse_args()
    if a.diagnose_no_hashing:
        from refitflow.refit import hashes as _unit_hashes

        _unit_hashes._whole_units = lambda *args, **kwargs: None  # type: ignore[assignment]
    numel = int(a.size_mb * 2**20 / 4 / a.tensors)
    spec = {"tensors": a.tensors, "numel": numel, "model": "bench"}
    dst = {f"layers.{i}.weight": torch.zeros(numel + i % 7) for i in range(a.tensors)}
    nbytes = sum(t.nbytes for t in dst.values())
    checks = "NO HASHING (diagnostic)" if a.diagnose_no_hashing else "strict verify"
    print(f"{a.tensors} fp32 tensors, {nbytes / 1e9:.3f} GB, mode {a.mode}, receiver agents {a.agents}, {checks}, "
          f"direct buckets {a.direct_bucket_mb:g} MiB")  # fmt: skip
    registry, identity = rf.Registry(), rf.Identity(model="bench")
    raw_t: list[float] = []
    results: list[rf.RefitResult] = []
    async with Peer(spec) as peer:
        first = await peer.publish(1, 1)
        raw = NixlTransport(num_agents=a.agents)
        transport = NixlTransport(num_agents=a.agents)
        try:
            options = {"direct_bucket_bytes": int(a.direct_bucket_mb * 2**20)}
            async with rf.Receiver(dst, registry, identity=identity, transport=transport, mode=a.mode,
                                   **options) as recv:  # fmt: skip
                for t in dst.values():
                    raw.register(t)
                raw.connect(first.source)
                reads = [Read(first.source.agent, s.region, s.offset, s.nbytes, as_bytes(dst[s.name]))
                         for s in first.shards]  # fmt: skip
                await raw.read(reads, key="all")  # prepare and wire up
                await registry.publish(first)
                await recv.refit(1)  # plan, descriptors, wire-up

                async def raw_read(v: int) -> None:
                    t0 = time.perf_counter()
                    await raw.read(reads, key="all")
                    raw_t.append(time.perf_counter() - t0)

                async def refit(v: int) -> None:
                    results.append(await recv.refit(v))

                for v in range(2, a.rounds + 2):
                    await registry.publish(await peer.publish(v, v))
                    # each first after the publish in every other round: what the processes still do after a
                    # publish (the trainer's frees, the registry taking the records) falls on both alike
                    for step in (raw_read, refit) if v % 2 == 0 else (refit, raw_read):
                        await step(v)
                    r = results[-1]
                    verify_ms = r.stages["verify"].seconds * 1e3
                    print(f"round {v - 1}: raw READ {nbytes / raw_t[-1] / 1e9:6.2f} GB/s, refit {r.gbps:6.2f} GB/s "
                          f"(ratio {raw_t[-1] / r.seconds:4.2f}); verify busy {verify_ms:.0f} ms")  # fmt: skip
        finally:
            await raw.aclose()
    refit_t = [r.seconds for r in results]
    med = statistics.median(raw_t) / statistics.median(refit_t)
    best = min(raw_t) / min(refit_t)
    raw_best, refit_best = nbytes / min(raw_t) / 1e9, nbytes / min(refit_t) / 1e9
    print(f"refit / raw READ: median {med:.2f}, best {best:.2f} (raw best {raw_best:.2f} GB/s, "
          f"refit best {refit_best:.2f} GB/s)")  # fmt: skip


if __name__ == "__main__":
    anyio.run(main)
