"""The shapes users pick today, done the way a competent user would, on the same bytes as refitflow.

- gloo into the parameters: ``torch.distributed.broadcast`` of every tensor from the trainer (rank 0)
  straight into the receiver's parameter (rank 1): no packing, no buffers.
- gloo packed buckets (the ATOM / vLLM-NCCL shape, on CPU): the trainer packs up to 64 MiB of tensors
  into one preallocated bucket, broadcasts it into the receiver's preallocated bucket, and the receiver
  unpacks it into its parameters; both buckets are reused for every bucket of every version.
- /dev/shm safetensors (the shared-storage shape): the trainer saves a file, the receiver opens it
  and copies every tensor into its parameter.

Each runs a trainer process and a receiver process (``run_processes``, one thread each). Every version
the trainer changes its weights (a training step, not timed), takes its go (``time.monotonic()``) and
sends; the receiver takes its done once every parameter holds the new bytes. ``time.monotonic`` is
``CLOCK_MONOTONIC``, one clock for all processes of a host, so done - go is the version's time. After
the last version each side reports the digest of its weights (equal: bit-exact) and its own peak RSS.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import tempfile
import time
from collections.abc import Callable
from typing import Any

import anyio
import torch

from refitflow.cli.demo import run_processes
from refitflow.cli.demo_roles import Report, peak_rss_bytes, weights_digest
from refitflow.cli.synthetic import synthetic_model
from refitflow.transports.base import as_bytes

__all__ = ["BUCKET", "GLOO", "SHM", "best_gbps", "gloo_rows", "memcpy_gbps", "shm_row"]

BUCKET = 64 << 20
GLOO = {  # method -> its row's name
    "into_params": "gloo broadcast into the parameters (per tensor)",
    "packed": "gloo packed 64 MiB buckets, reused (NCCL shape)",
}
SHM = "/dev/shm safetensors: save, open, copy in"


def memcpy_gbps(nbytes: int, threads: int = 1) -> float:
    """Best of five ``dst.copy_(src)`` of ``nbytes`` with torch using ``threads`` threads."""
    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)
    return nbytes / min(times) / 1e9


def best_gbps(nbytes: int, seconds: list[float]) -> tuple[float, float]:
    """(best of the warm versions, first version) GB/s of ``nbytes`` moved in per-version ``seconds``."""
    return nbytes / min(seconds[1:] or seconds) / 1e9, nbytes / seconds[0] / 1e9


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _step(model: dict[str, torch.Tensor]) -> None:
    for t in model.values():  # a training step changes the weights in place (as refitflow's trainer role does)
        t.add_(0.25)


def _done(report: Report, rank: int, method: str, marks: list[float], model: dict[str, torch.Tensor],
          staging: int) -> None:  # fmt: skip
    report({"kind": "baseline", "method": method, "rank": rank, "marks": marks, "rss": peak_rss_bytes(),
            "digest": weights_digest(model), "staging": staging})  # fmt: skip


def _buckets(model: dict[str, torch.Tensor]) -> list[list[tuple[torch.Tensor, int]]]:
    """Tensors packed in order into buckets of at most BUCKET bytes (one larger tensor: a bucket alone)."""
    out: list[list[tuple[torch.Tensor, int]]] = [[]]
    size = 0
    for t in model.values():
        if out[-1] and size + t.nbytes > BUCKET:
            out.append([])
            size = 0
        out[-1].append((as_bytes(t), size))
        size += t.nbytes
    return out


def _packed(model: dict[str, torch.Tensor], rank: int) -> tuple[Callable[[], None], int]:
    """The packed baseline's send for this rank, and its bucket's bytes."""
    import torch.distributed as dist

    buckets = _buckets(model)
    bucket = torch.zeros(max(off + t.numel() for b in buckets for t, off in b), dtype=torch.uint8)

    def send() -> None:
        for b in buckets:
            end = b[-1][1] + b[-1][0].numel()
            if rank == 0:
                for t, off in b:
                    bucket[off : off + t.numel()].copy_(t)
            dist.broadcast(bucket[:end], src=0)
            if rank == 1:
                for t, off in b:
                    t.copy_(bucket[off : off + t.numel()])

    return send, bucket.numel()


async def gloo_role(rank: int, port: int, size: int, versions: int, report: Report) -> None:
    """One side of both gloo baselines, one after the other in the same two processes."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        model = synthetic_model(size, seed=rank)  # the receiver starts from other weights

        def into_params() -> None:
            for t in model.values():
                dist.broadcast(t, src=0)

        for method, (send, staging) in (("into_params", (into_params, 0)), ("packed", _packed(model, rank))):
            marks = []
            for _ in range(versions):
                if rank == 0:
                    _step(model)
                dist.barrier()
                t0 = time.monotonic()  # the trainer's go
                send()
                marks.append(t0 if rank == 0 else time.monotonic())
            _done(report, rank, method, marks, model, staging)
    finally:
        dist.destroy_process_group()


async def shm_role(rank: int, path: str, size: int, versions: int, go: Any, done: Any, report: Report) -> None:
    """The trainer (rank 0) saves to ``path`` and says go; the receiver (rank 1) opens it and copies in."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    model = synthetic_model(size, seed=rank)
    marks = []
    for _ in range(versions):
        if rank == 0:
            _step(model)
            t0 = time.monotonic()  # the trainer's go: the save counts
            save_file(model, path)
            go.put(True)
            marks.append(t0)
            done.get(timeout=600)
        else:
            go.get(timeout=600)
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    model[name].copy_(f.get_tensor(name))
            marks.append(time.monotonic())
            done.put(True)
    file_bytes = (await anyio.Path(path).stat()).st_size  # the file in shared memory
    _done(report, rank, "shm", marks, model, file_bytes)


def _row(events: list[dict[str, Any]], method: str, nbytes: int) -> dict[str, Any]:
    """A baseline's row from its two processes' events: done - go per version, RSS of each side, bit-exact."""
    trainer, receiver = (next(e for e in events if e.get("method") == method and e["rank"] == r) for r in (0, 1))
    seconds = [done - go for go, done in zip(trainer["marks"], receiver["marks"], strict=True)]
    best, first = best_gbps(nbytes, seconds)
    return {"e2e_gbps": best, "first_e2e_gbps": first, "e2e_seconds": seconds, "receiver_gbps": None,
            "trainer_rss": trainer["rss"], "receiver_rss": receiver["rss"], "peak_staging": receiver["staging"],
            "exact": trainer["digest"] == receiver["digest"]}  # fmt: skip


async def _pair(role: Callable[..., Any], args: tuple[Any, ...], label: str, timeout_s: float) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    roles = [(role, (r, *args), f"{label} {('trainer', 'receiver')[r]}") for r in (0, 1)]
    await run_processes(roles, timeout_s, events.append)
    errors = [e["error"] for e in events if e["kind"] == "error"]
    if errors:
        raise RuntimeError(f"{label}: {errors}")
    return events


async def gloo_rows(size: int, nbytes: int, versions: int, timeout_s: float) -> dict[str, dict[str, Any]]:
    events = await _pair(gloo_role, (_free_port(), size, versions), "gloo", timeout_s)
    return {name: _row(events, method, nbytes) for method, name in GLOO.items()}


async def shm_row(size: int, nbytes: int, versions: int, timeout_s: float) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    go, done = ctx.Queue(), ctx.Queue()
    with tempfile.TemporaryDirectory(dir="/dev/shm") as tmp:
        path = os.path.join(tmp, "model.safetensors")
        events = await _pair(shm_role, (path, size, versions, go, done), "shm", timeout_s)
    return _row(events, "shm", nbytes)
