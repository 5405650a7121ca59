"""One prepared check of the CUDA paths, for a lent GPU machine: ``python bench/gpu_check.py [--gib 1]``.

Two NIXL agents in one process (UCX picks cuda_ipc / cuda_copy): every direction between host memory
(DRAM) and device memory (VRAM) is read once cold and five times replayed, checked byte for byte,
and timed (GB/s = 10^9 B/s). Exits non-zero on any mismatch or error; exits 2 when there is no CUDA.

Known gap (not checked here): the publisher's digests and the verify stage hash on the CPU (numpy),
so an end-to-end refit into CUDA parameters is not yet possible; this checks the transport alone.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("UCX_LOG_LEVEL", "error")

import anyio
import torch

from refitflow.transports.base import Read, as_bytes
from refitflow.transports.nixl import NixlTransport


async def check(src_dev: str, dst_dev: str, nbytes: int) -> tuple[float, float]:
    owner, reader = NixlTransport(), NixlTransport()
    try:
        src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=src_dev)
        dst = torch.zeros(nbytes, dtype=torch.uint8, device=dst_dev)
        region = owner.register(src)
        reader.register(dst)
        reader.connect(owner.address())
        chunk = 64 << 20
        reads = [
            Read(
                owner.agent, region, off, min(chunk, nbytes - off), as_bytes(dst)[off : off + min(chunk, nbytes - off)]
            )
            for off in range(0, nbytes, chunk)
        ]
        times = []
        for _ in range(6):
            dst.zero_()
            if dst.is_cuda or src.is_cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            await reader.read(reads, key="gpu-check")
            if dst.is_cuda or src.is_cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            if not torch.equal(src.cpu(), dst.cpu()):
                raise SystemExit(f"MISMATCH {src_dev} -> {dst_dev}")
        return nbytes / times[0] / 1e9, nbytes / min(times[1:]) / 1e9
    finally:
        await reader.aclose()
        await owner.aclose()


async def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.0)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check here")
        return 2
    nbytes = int(args.gib * 2**30)
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, {nbytes / 2**30:.2f} GiB per read")
    torch.cuda.init()  # NIXL wants a CUDA context before its agents are created
    for src, dst in (("cuda:0", "cuda:0"), ("cpu", "cuda:0"), ("cuda:0", "cpu"), ("cpu", "cpu")):
        cold, warm = await check(src, dst, nbytes)
        print(f"{src:>6} -> {dst:<6}  bit-exact  first {cold:7.2f} GB/s  replayed {warm:7.2f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(anyio.run(main))
