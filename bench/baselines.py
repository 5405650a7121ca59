"""The shapes users pick today, measured on the same bytes as refitflow (each in real processes).

- gloo: torch.distributed broadcast of packed buckets from rank 0 (the ATOM / vLLM-NCCL shape, on CPU).
- shm: save a safetensors file to /dev/shm, load it in the receiver and copy into its parameters
  (the shared-storage shape).

Each baseline runs a trainer process and a receiver process; the receiver reports the seconds from
the trainer's "go" to every parameter holding the new bytes, and its peak RSS.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import resource
import socket
import tempfile
import time
from typing import Any

import torch

from refitflow.cli.synthetic import synthetic_model

__all__ = ["gloo_broadcast", "memcpy_gbps", "shm_safetensors"]

BUCKET = 64 << 20


def memcpy_gbps(nbytes: int) -> float:
    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return nbytes / min(times) / 1e9


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def _buckets(tensors: dict[str, torch.Tensor]) -> list[list[str]]:
    out: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        if out[-1] and size + t.nbytes > BUCKET:
            out.append([])
            size = 0
        out[-1].append(name)
        size += t.nbytes
    return out


def _gloo_rank(rank: int, port: int, size: int, versions: int, q: Any) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    model = synthetic_model(size, seed=rank)
    groups = _buckets(model)
    times = []
    for _ in range(versions):
        dist.barrier()
        t0 = time.perf_counter()
        for names in groups:
            if rank == 0:  # pack a bucket (the trainer-side copy these systems make)
                flat = torch.cat([model[n].reshape(-1).view(torch.uint8) for n in names])
            else:
                flat = torch.empty(sum(model[n].nbytes for n in names), dtype=torch.uint8)
            dist.broadcast(flat, src=0)
            if rank == 1:
                off = 0
                for n in names:
                    nb = model[n].nbytes
                    model[n].view(-1).view(torch.uint8).copy_(flat[off : off + nb])
                    off += nb
        times.append(time.perf_counter() - t0)
    if rank == 1:
        exact = _same(model, synthetic_model(size, seed=0))
        q.put({"seconds": min(times), "rss": _rss_bytes(), "exact": exact})
    dist.destroy_process_group()


def gloo_broadcast(size: int, versions: int = 3) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_gloo_rank, args=(r, port, size, versions, q)) for r in (0, 1)]
    for p in procs:
        p.start()
    result = q.get(timeout=600)
    for p in procs:
        p.join(timeout=60)
    return result


def _shm_receiver(path: str, size: int, go: Any, done: Any, q: Any) -> None:
    from safetensors.torch import load_file

    torch.set_num_threads(1)
    model = synthetic_model(size, seed=1)
    times = []
    while True:
        t0 = go.get(timeout=600)
        if t0 is None:
            break
        loaded = load_file(path)
        for n, t in loaded.items():
            model[n].copy_(t)
        del loaded
        times.append(time.time() - t0)
        done.put(True)
    exact = _same(model, synthetic_model(size, seed=0))
    q.put({"seconds": min(times), "rss": _rss_bytes(), "exact": exact})


def shm_safetensors(size: int, versions: int = 3) -> dict[str, Any]:
    from safetensors.torch import save_file

    torch.set_num_threads(1)
    ctx = mp.get_context("spawn")
    go, done, q = ctx.Queue(), ctx.Queue(), ctx.Queue()
    model = synthetic_model(size, seed=0)
    with tempfile.TemporaryDirectory(dir="/dev/shm") as tmp:
        path = os.path.join(tmp, "model.safetensors")
        proc = ctx.Process(target=_shm_receiver, args=(path, size, go, done, q))
        proc.start()
        for _ in range(versions):
            t0 = time.time()
            save_file(model, path)
            go.put(t0)
            done.get(timeout=600)
        go.put(None)
        result = q.get(timeout=600)
        proc.join(timeout=60)
    return result
