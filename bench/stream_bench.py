"""The push stream over gloo against refitflow's NIXL pull, on the same bytes, in one run.

    python bench/stream_bench.py [--size-mb 256] [--versions 3] [--bucket-mb 32] [--budget-mb 64]

Stream rows: a trainer process (``rf.StreamSender``, group rank 0) and one inference process
(``rf.StreamReceiver``, rank 1, in place) in a gloo group built by ``rf.stream_group`` on loopback.
Per version: the receiver's seconds from the first header to prepared ("receiver only") and from
the sender's ``send()`` to the receiver's commit ("send→commit"; both processes on one host read
``time.monotonic``, one clock), and its peak resident bucket bytes against the budget (one bucket
at a time; the sender's packing buffer is ``--bucket-mb``; an oversize tensor travels alone).
Pull row: ``python -m bench``'s refitflow over NIXL, in place (trainer process publishing two
ranks, receiver process, registry service), on the same synthetic bf16 model, timed the same two
ways (publish→commit includes the trainer's digests). Best warm version; GB/s = 10^9 bytes/s.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import pathlib
import sys
import time
from typing import Any

os.environ.setdefault("UCX_NET_DEVICES", "lo")  # a benchmark entry point, like the CLI, may set the environment
os.environ.setdefault("UCX_LOG_LEVEL", "error")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import anyio
import torch

import refitflow as rf
from bench.__main__ import refitflow_row
from bench.baselines import _free_port
from refitflow.cli.demo_roles import RoleConfig, receiver_role
from refitflow.cli.synthetic import synthetic_model, synthetic_nbytes


def _weights(size: int, version: int) -> dict[str, torch.Tensor]:
    model = synthetic_model(size)
    for _ in range(version - 1):  # a training step changes the weights (as the pull row's trainer does)
        for t in model.values():
            t.add_(0.25)
    return model


async def _sender(group: rf.StreamGroup, size: int, versions: int, bucket: int) -> dict[str, Any]:
    sender = rf.StreamSender(group, bucket_bytes=bucket)
    model, sent, starts = synthetic_model(size), [], []
    for version in range(1, versions + 1):
        if version > 1:
            for t in model.values():
                t.add_(0.25)
        starts.append(time.monotonic())
        sent.append(await sender.send(version, model))
    return {"buckets": sent[-1].buckets, "seconds": [s.seconds for s in sent], "t_send": starts}


async def _receiver(group: rf.StreamGroup, size: int, versions: int, budget: int) -> dict[str, Any]:
    model = {n: torch.zeros_like(t) for n, t in synthetic_model(size).items()}
    recv = rf.StreamReceiver(model, group, budget_bytes=budget)
    results, commits = [], []
    for _ in range(versions):
        results.append(await recv.refit(timeout=300))
        commits.append(time.monotonic())
    exact = all(torch.equal(model[n], t) for n, t in _weights(size, versions).items())
    return {"results": [(r.nbytes, r.seconds, r.peak_staging_bytes) for r in results], "exact": exact,
            "t_commit": commits}  # fmt: skip


def _role(rank: int, port: int, args: tuple[int, int, int, int], queue: Any) -> None:
    torch.set_num_threads(1)
    size, versions, bucket, budget = args
    try:
        group = rf.stream_group(f"127.0.0.1:{port}", world_size=2, rank=rank, timeout_s=300)
        if rank == 0:
            queue.put((rank, anyio.run(_sender, group, size, versions, bucket)))
        else:
            queue.put((rank, anyio.run(_receiver, group, size, versions, budget)))
    except BaseException as exc:
        queue.put((rank, {"error": f"{type(exc).__name__}: {exc}"}))
        raise


def stream_row(size: int, versions: int, bucket: int, budget: int) -> dict[int, dict[str, Any]]:
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=_role, args=(r, port, (size, versions, bucket, budget), queue)) for r in (0, 1)]
    for p in procs:
        p.start()
    out = dict(queue.get(timeout=1200) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    errors = [r["error"] for r in out.values() if "error" in r]
    if errors:
        raise RuntimeError(errors)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-mb", type=float, default=256.0, help="model size, MB (10^6 bytes)")
    ap.add_argument("--versions", type=int, default=3)
    ap.add_argument("--bucket-mb", type=float, default=32.0, help="sender bucket, MiB")
    ap.add_argument("--budget-mb", type=float, default=64.0, help="receiver budget, MiB")
    args = ap.parse_args()
    size = int(args.size_mb * 1e6)
    bucket, budget = int(args.bucket_mb * 2**20), int(args.budget_mb * 2**20)
    nbytes = synthetic_nbytes(size)
    print(f"model {nbytes / 1e9:.3f} GB bf16, {args.versions} versions, {os.cpu_count()} CPUs, "
          f"torch {torch.__version__}; GB/s = 1e9 B/s")  # fmt: skip
    stream = stream_row(size, args.versions, bucket, budget)
    rows = stream[1]["results"]
    best = max(n / s for n, s, _ in rows[1:] or rows) / 1e9
    e2e = [c - t for c, t in zip(stream[1]["t_commit"], stream[0]["t_send"], strict=True)]
    pairs = [(n, e) for (n, _, _), e in zip(rows, e2e, strict=True)]
    best_e2e = max(n / e for n, e in pairs[1:] or pairs) / 1e9
    peak = max(p for _, _, p in rows)
    print(f"stream: {stream[0]['buckets']} buckets per version; bit-exact after {args.versions} versions: "
          f"{stream[1]['exact']}")  # fmt: skip
    for i, (n, s, p) in enumerate(rows, start=1):
        sender_ms = stream[0]["seconds"][i - 1] * 1e3
        print(f"  v{i}: {n / s / 1e9:6.2f} GB/s in {s * 1e3:8.1f} ms (sender {sender_ms:8.1f} ms); "
              f"peak resident bucket {p / 2**20:6.1f} MiB of a {args.budget_mb:.0f} MiB budget")  # fmt: skip
    cfg = RoleConfig(size_bytes=size, versions=args.versions, budget_bytes=budget, transport="nixl", timeout_s=600)
    pull = anyio.run(refitflow_row, cfg, receiver_role, "in_place")
    print(f"{'path':<44} {'send→commit GB/s':>17} {'receiver GB/s':>14} {'peak staging MiB':>17}")
    print(f"{'refitflow stream over gloo (push, in place)':<44} {best_e2e:17.2f} {best:14.2f} {peak / 2**20:17.1f}")
    print(f"{'refitflow NIXL pull (in place)':<44} {pull['e2e_gbps']:17.2f} {pull['gbps']:14.2f} "
          f"{pull['peak_staging'] / 2**20:17.1f}")  # fmt: skip
    print(f"pull / stream: send→commit {pull['e2e_gbps'] / best_e2e:.2f}x, receiver only {pull['gbps'] / best:.2f}x")


if __name__ == "__main__":
    main()
