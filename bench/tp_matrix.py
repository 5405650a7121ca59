"""Re-sharding plans for every TP m → n, m, n ∈ {1, 2, 4, 8}: bytes pulled per rank vs its slice, reads, plan time.

    python bench/tp_matrix.py [--model llama-8b|llama-70b] [--verify strict] [--tp 1 2 4 8] [--descriptor-bytes N]

Plans only (no bytes move): a Megatron-sharded bf16 trainer of the real model's shapes (synthetic
digests of the publisher's tile geometry) into fused bf16 inference ranks held as ``meta`` tensors.
Per (m, n) it prints the worst rank's pulled/slice ratio, its planned reads and its plan seconds
(wall, and the process's CPU seconds: robust on a shared machine) — the plan a refit builds, not the
receiver's own part (``planner.ReceiverLayout``, built once as the receiver starts), and with refitflow's
memos emptied before each rank (``cold``).
"""

from __future__ import annotations

import argparse
import base64
import sys
import time

import torch

import refitflow as rf
from refitflow.core.digests import Tiling, choose_tiling
from refitflow.layouts import ModelDims, Parallel, fused, megatron
from refitflow.layouts.wire import layout_metadata
from refitflow.planner import Plan, build_plan
from refitflow.planner.receiver_layout import ReceiverLayout
from refitflow.refit.config import ReceiverConfig
from refitflow.refit.destination import ApplyMode, Destination

MODELS = {
    "llama-8b": ModelDims(vocab=128256, hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128, ffn=14336),
    "llama-70b": ModelDims(vocab=128256, hidden=8192, layers=80, heads=64, kv_heads=8, head_dim=128, ffn=28672),
}


def publication(d: ModelDims, tp: int, algo: str = "xxh3") -> rf.Publication:
    """A Megatron TP ``tp`` publication of ``d``'s shapes, bf16, with the publisher's tile geometry."""
    ident = rf.Identity(model="bench", layout="megatron")
    manifests = []
    for r in range(tp):
        par = Parallel(tp=tp, tp_rank=r)
        shards = []
        for i, (name, lt) in enumerate(megatron.layout(d, par).items()):
            rows, cols = choose_tiling(lt.shape, 2)
            count = Tiling(algo, lt.shape, 2, rows, cols).count
            blocks = base64.b64encode(bytes(8 * count)).decode()
            shards.append(rf.ShardSpec(
                name=name, dtype="bfloat16", global_shape=lt.shape, axis=None, start=0, stop=lt.shape[0],
                digest="0" * 16, region=i, algo=algo, tile_rows=rows, tile_cols=cols, blocks=blocks,
            ))  # fmt: skip
        source = rf.SourceAddress(transport="loopback", agent=f"t{r}")
        manifests.append(rf.Manifest(
            identity=ident, version=1, rank=r, world_size=tp, source=source, shards=tuple(shards),
            metadata=layout_metadata("megatron", d, par),
        ))  # fmt: skip
    return rf.Publication(identity=ident, version=1, manifests=tuple(manifests))


def rank_target(d: ModelDims, tp: int, rank: int) -> ReceiverLayout:
    """The receiving rank's parameters and what plans need of them (a receiver builds this as it starts)."""
    lay = fused.layout(d, Parallel(tp=tp, tp_rank=rank))
    params = {n: torch.empty(lt.shape, dtype=torch.bfloat16, device="meta") for n, lt in lay.items()}
    return ReceiverLayout(Destination(params, ApplyMode.IN_PLACE, lay))


def cold() -> None:
    """Empty every memo of refitflow's (box algebra, digest units, tilings): each receiving rank is a process
    of its own, and its first plan meets none of the shapes another rank's plan met."""
    for name, module in list(sys.modules.items()):
        if name.startswith("refitflow"):
            for value in vars(module).values():
                if callable(getattr(value, "cache_clear", None)):
                    value.cache_clear()


def rank_plan(pub: rf.Publication, target: ReceiverLayout, verify: str, **config: int) -> Plan:
    return build_plan(pub, target, ReceiverConfig(verify=verify, **config).limits)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=sorted(MODELS), default="llama-8b")
    ap.add_argument("--verify", choices=("strict", "pulled"), default="strict")
    ap.add_argument("--algo", choices=("xxh3", "mix64"), default="xxh3")
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--descriptor-bytes", type=int, default=ReceiverConfig().descriptor_bytes,
                    help="ReceiverConfig.descriptor_bytes (0: column slices read as such, never as whole rows)")
    a = ap.parse_args()
    d = MODELS[a.model]
    print(f"{a.model}, Megatron TP m (bf16) -> fused TP n, verify={a.verify}, digests {a.algo}, descriptor_bytes "
          f"{a.descriptor_bytes}; worst rank per (m, n)")  # fmt: skip
    print(f"{'m':>2} {'n':>2} {'slice GB':>9} {'pulled/slice':>12} {'reads':>7} {'descriptors':>11} {'plan s':>7} "
          f"{'CPU s':>7}")  # fmt: skip
    for m in a.tp:
        pub = publication(d, m, a.algo)
        for n in a.tp:
            worst = (0.0, 0, 0.0, 0.0, 0, 0)
            for r in range(n):
                target = rank_target(d, n, r)
                cold()
                t0, c0 = time.perf_counter(), time.process_time()
                plan = rank_plan(pub, target, a.verify, descriptor_bytes=a.descriptor_bytes)
                secs, cpu = time.perf_counter() - t0, time.process_time() - c0
                reads = sum(len(b.reads) for b in plan.buckets)
                ratio = plan.nbytes / plan.ideal_bytes
                descriptors = sum(rd.count for b in plan.buckets for rd in b.reads)
                worst = (max(worst[0], ratio), max(worst[1], reads), max(worst[2], secs), max(worst[3], cpu),
                         plan.ideal_bytes, max(worst[5], descriptors))  # fmt: skip
            print(f"{m:>2} {n:>2} {worst[4] / 1e9:9.2f} {worst[0]:12.4f} {worst[1]:7d} {worst[5]:11d} {worst[2]:7.3f} "
                  f"{worst[3]:7.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
