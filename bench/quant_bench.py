"""FP8 serving from a bf16 trainer: quantise on the receiver vs publish FP8, bytes moved and time, one run.

    PYTHONPATH=src:. python bench/quant_bench.py [--tensors 24] [--rows 2048] [--cols 2048] [--versions 3]

Both sides refit the same FP8 (``fp8_block128``) receiver over NIXL (publisher and receiver in this process,
DRAM to DRAM), every version a full refit (``skip_unchanged=False``):
- **bf16 published**: the trainer publishes its bf16 weights; the receiver pulls them and quantises each
  tensor at commit (on its device: here the CPU).
- **FP8 published**: the trainer quantises (refitflow's ``quantize``, timed, on the trainer's device: here
  the CPU) and publishes values and scales; the receiver copies them.
Printed per side: bytes pulled, refit seconds (median of the versions), the trainer's quantise seconds, and
their sum — the same work counted on both sides. GB/s = 10^9 bytes per second.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("UCX_NET_DEVICES", "lo")  # a benchmark script, like the CLI, may set the environment

import anyio
import torch

import refitflow as rf
from refitflow.layouts.quant import FORMATS
from refitflow.layouts.quant_math import quantize

FMT = FORMATS["fp8_block128"]


def receiver_tensors(n: int, rows: int, cols: int) -> dict[str, torch.Tensor]:
    out = {}
    for i in range(n):
        out[f"w{i}"] = torch.zeros(rows, cols, dtype=torch.float8_e4m3fn)
        out[f"w{i}_scale_inv"] = torch.zeros(FMT.scale_shape((rows, cols)))
    return out


def quantised(weights: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], float]:
    t0 = time.perf_counter()
    out = {}
    for name, w in weights.items():
        q, s, _ = quantize(FMT, w.float())
        out[name], out[name + "_scale_inv"] = q, s
    return out, time.perf_counter() - t0


async def side(fp8: bool, weights: list[dict[str, torch.Tensor]], rows: int, cols: int) -> dict[str, float]:
    registry, ident = rf.Registry(), rf.Identity(model="quant-bench")
    dest = receiver_tensors(len(weights[0]), rows, cols)
    refit_s, quant_s, nbytes = [], [], 0
    async with (
        rf.Publisher(registry, identity=ident, transport="nixl") as pub,
        rf.Receiver(dest, registry, identity=ident, transport="nixl", skip_unchanged=False,
                    budget_bytes=256 << 20) as recv,
    ):  # fmt: skip
        for version, w in enumerate(weights, start=1):
            tensors, q_s = quantised(w) if fp8 else (w, 0.0)
            await pub.publish(version, tensors)
            result = await recv.refit(version, timeout=600)
            refit_s.append(result.seconds)
            quant_s.append(q_s)
            nbytes = result.nbytes
            await pub.released(version, timeout=60)
    refit, quant = statistics.median(refit_s[1:] or refit_s), statistics.median(quant_s[1:] or quant_s)
    return {"bytes": nbytes, "refit_s": refit, "quant_s": quant, "total_s": refit + quant}


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tensors", type=int, default=24)
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--cols", type=int, default=2048)
    ap.add_argument("--versions", type=int, default=3)
    a = ap.parse_args()
    torch.manual_seed(0)
    weights = [
        {f"w{i}": (torch.randn(a.rows, a.cols) * 0.02).to(torch.bfloat16) for i in range(a.tensors)}
        for _ in range(a.versions)
    ]
    size = a.tensors * a.rows * a.cols * 2
    print(f"{a.tensors} tensors of {a.rows}x{a.cols} bf16 = {size / 1e6:.0f} MB; {a.versions} versions; torch threads "
          f"{torch.get_num_threads()}")  # fmt: skip
    rows = {"bf16 published, quantised on the receiver": await side(False, weights, a.rows, a.cols),
            "FP8 published (trainer quantises)": await side(True, weights, a.rows, a.cols)}  # fmt: skip
    print(f"{'path':44} {'MB pulled':>10} {'refit s':>8} {'trainer quantise s':>19} {'total s':>8}")
    for name, r in rows.items():
        print(f"{name:44} {r['bytes'] / 1e6:10.1f} {r['refit_s']:8.3f} {r['quant_s']:19.3f} {r['total_s']:8.3f}")
    a_, b_ = rows.values()
    fewer, faster, total = a_["bytes"] / b_["bytes"], a_["refit_s"] / b_["refit_s"], a_["total_s"] / b_["total_s"]
    print(f"FP8 published moves {fewer:.2f}x fewer bytes; its refit is {faster:.2f}x faster, {total:.2f}x counting "
          "the trainer's quantise")  # fmt: skip


if __name__ == "__main__":
    anyio.run(main)
