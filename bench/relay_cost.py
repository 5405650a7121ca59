"""What a relayed bucket costs a reader beyond its bytes: the slope of refit time over bucket count, relay against
trainer, same bytes, same reader.

    python bench/relay_cost.py [--size-mb 64] [--tensors 2048] [--buckets 4 64 256 1024] [--rounds 5]

For each bucket count: a publisher process (NIXL, xxh3 digests), and in this process a relay (a shadow receiver
that serves replicas) and a reader, both cutting the same bytes into about that many buckets. Versions alternate:
the reader refits first — nobody relays the version yet, it reads the trainer — or the relay does and the reader
then reads every byte from it (already verified: the reader is behind its relay, as in a fleet's steady state).
Per bucket count it prints the reader's best seconds each way; then the least-squares slopes over bucket count
and their difference: **a relayed bucket's own cost** (status reads, the relay's bookkeeping, the reads of another
agent's memory — what the simulator calls ``relay_bucket_us``); and **a status read's CPU** (this process's, every
thread: 2,000 reads of the relay's status words back to back, the path a waiting reader's reads take — what the
simulator calls ``status_us``). Strict verify on both paths. The tensors are
smaller than the smallest bucket, so buckets hold whole tensors and every piece is relayable (the run stops if a
byte came from elsewhere: a 1-D tensor cut between two buckets has its one digest block completed across pieces,
and such pieces are read from the trainer — ``planner/fanout.py``).
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
from refitflow.refit.fanout.reading import status_read
from refitflow.transports.nixl import NixlTransport


def slope(x: list[int], y: list[float]) -> float:
    return float(np.polyfit(np.asarray(x, dtype=float), np.asarray(y, dtype=float), 1)[0])


async def one_count(k: int, a: argparse.Namespace) -> tuple[int, float, float, float]:
    """(buckets, the reader's best seconds from the trainer, from the relay, a status read's CPU in microseconds —
    measured at the fewest buckets only) for about ``k`` buckets."""
    numel = int(a.size_mb * 2**20 / 4 / a.tensors)
    spec = {"tensors": a.tensors, "numel": numel, "model": "bench"}
    shapes = {f"layers.{i}.weight": numel + i % 7 for i in range(a.tensors)}
    nbytes = sum(shapes.values()) * 4
    size = max(64, -(-nbytes // k))
    buckets = {"direct_bucket_bytes": size, "relay_bucket_bytes": size, "max_direct_buckets": 1 << 20}
    registry, identity = rf.Registry(), rf.Identity(model="bench")
    trainer_s: list[float] = []
    relay_s: list[float] = []
    made = 0
    async with Peer(spec) as peer:
        relay = rf.Receiver({n: torch.zeros(s) for n, s in shapes.items()}, registry, identity=identity,
                            transport=NixlTransport(), mode="shadow", serve_replicas=True, receiver_id="relay",
                            **buckets)  # fmt: skip
        reader = rf.Receiver({n: torch.zeros(s) for n, s in shapes.items()}, registry, identity=identity,
                             transport=NixlTransport(), mode="shadow", receiver_id="reader", **buckets)  # fmt: skip
        async with relay, reader:
            for v in range(1, 2 * (a.rounds + 1) + 1):  # the first two versions prepare (plans, descriptors)
                await registry.publish(await peer.publish(v, v))
                if v % 2:
                    r = await reader.refit(v)
                    assert r.relay_bytes == 0, r
                    await relay.refit(v)
                    out = trainer_s
                else:
                    await relay.refit(v)
                    r = await reader.refit(v)
                    assert r.relay_bytes == r.nbytes and not r.rerouted_bytes, r  # every byte from the relay
                    out = relay_s
                made = r.stages["pull"].items
                if v > 2:
                    out.append(r.seconds)
            status_us = await _status_reads(relay, reader) if k == min(a.buckets) else float("nan")
    return made, min(trainer_s), min(relay_s), status_us


async def _status_reads(relay: rf.Receiver, reader: rf.Receiver, n: int = 2000) -> float:
    """The CPU (this process's, every thread) of one read of the relay's status words, as a waiting reader makes
    it (``refit.fanout.reading.status_read``, a keyed read through the transport; the status is tiny): n back to back,
    microseconds each."""
    src, dst = relay._transport, reader._transport  # a benchmark's look inside: the status read's own path
    assert relay._relaying is not None and src is not None and dst is not None
    status = next(iter(relay._relaying.status.values()))
    probe = torch.zeros_like(status)
    dst.register(probe)
    dst.connect(src.address())
    reads = status_read(src.agent, src.register(status), probe)
    await dst.read(reads, key=("status-bench",), count=False)  # prepared once, as a reader's is
    t0 = time.process_time()
    for _ in range(n):
        await dst.read(reads, key=("status-bench",), count=False)
    return (time.process_time() - t0) / n * 1e6


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-mb", type=float, default=64)
    ap.add_argument("--tensors", type=int, default=2048)
    ap.add_argument("--buckets", type=int, nargs="+", default=[4, 64, 256, 1024])
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    print(f"{a.tensors} fp32 tensors, {a.size_mb:g} MiB, strict verify; buckets {a.buckets}, best of {a.rounds}; "
          f"load average {os.getloadavg()[0]:.2f}")  # fmt: skip
    rows = [await one_count(k, a) for k in a.buckets]
    print("\n| buckets | from the trainer, best s | from the relay, best s |\n|---:|---:|---:|")
    for made, t, r, _ in rows:
        print(f"| {made} | {t:.4f} | {r:.4f} |")
    ks = [made for made, _, _, _ in rows]
    per_trainer = slope(ks, [t for _, t, _, _ in rows])
    per_relay = slope(ks, [r for _, _, r, _ in rows])
    status_us = min(row[3] for row in rows if row[3] == row[3])
    print(f"\nper bucket: from the trainer {per_trainer * 1e6:.0f} us, from the relay {per_relay * 1e6:.0f} us; "
          f"a relayed bucket's own {(per_relay - per_trainer) * 1e6:.0f} us (slopes of the best times over bucket "
          f"count); a status read's CPU {status_us:.0f} us (every thread of this process)")  # fmt: skip


if __name__ == "__main__":
    anyio.run(main)
