"""Bytes pulled vs ideal for a mixed-TP refit: a Megatron-sharded trainer into fused inference ranks.

    python bench/layout_bench.py [--hidden 1024] [--layers 4] [--train-tp 2] [--infer-tp 4] [--experts 0]

Synthetic weights (no transformers needed), bf16 trainer, fp32 inference ranks. For each verify
mode it prints, per inference rank, the bytes pulled, the ideal (its slice alone), the ratio,
the buckets pulled and the unverified bytes.
"""

from __future__ import annotations

import argparse
import contextlib
import time

import anyio
import torch

import refitflow as rf
from refitflow.layouts import ModelDims, Parallel, canonical_shapes, fused, megatron
from refitflow.layouts.canonical import from_canonical
from refitflow.layouts.wire import layout_metadata


async def refit(d: ModelDims, train_tp: int, infer_tp: int, verify: str, ep: int) -> list[rf.RefitResult]:
    torch.manual_seed(0)
    canon = {n: torch.randn(s).to(torch.bfloat16) for n, s in canonical_shapes(d).items()}
    registry, ident = rf.Registry(), rf.Identity(model="bench", layout="megatron")
    pars = [Parallel(tp=train_tp, tp_rank=r % train_tp, ep=ep, ep_rank=r // train_tp) for r in range(train_tp * ep)]
    results = []
    async with contextlib.AsyncExitStack() as stack:
        for r, p in enumerate(pars):
            meta = layout_metadata("megatron", d, p)
            pub = await stack.enter_async_context(
                rf.Publisher(registry, identity=ident, rank=r, world_size=len(pars), metadata=meta)
            )
            await pub.publish(1, from_canonical(megatron.layout(d, p), canon))
        for r in range(infer_tp):
            lay = fused.layout(d, Parallel(tp=infer_tp, tp_rank=r))
            tensors = {n: torch.zeros(lt.shape) for n, lt in lay.items()}
            async with rf.Receiver(tensors, registry, identity=ident, layout=lay, verify=verify) as recv:
                results.append(await recv.refit(1, timeout=60))
    return results


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--train-tp", type=int, default=2)
    ap.add_argument("--infer-tp", type=int, default=4)
    ap.add_argument("--experts", type=int, default=0)
    a = ap.parse_args()
    h = a.hidden
    moe = dict(experts=a.experts, expert_ffn=h) if a.experts else dict(ffn=h * 3)
    d = ModelDims(vocab=8 * h, hidden=h, layers=a.layers, heads=16, kv_heads=4, head_dim=h // 16, **moe)  # type: ignore[arg-type]
    ep = 2 if a.experts else 1
    print(f"trainer megatron TP={a.train_tp} EP={ep} bf16 -> fused TP={a.infer_tp} fp32, hidden {h}, {a.layers} layers")
    for verify in ("pulled", "strict"):
        t0 = time.perf_counter()
        results = anyio.run(refit, d, a.train_tp, a.infer_tp, verify, ep)
        pulled, ideal = sum(r.nbytes for r in results), sum(r.ideal_bytes for r in results)
        print(f"verify={verify}: pulled {pulled / 1e6:.2f} MB, ideal {ideal / 1e6:.2f} MB, "
              f"ratio {pulled / ideal:.4f}, {time.perf_counter() - t0:.1f} s")  # fmt: skip
        for r, res in enumerate(results):
            print(f"  rank {r}: pulled {res.nbytes:>11,} ideal {res.ideal_bytes:>11,} "
                  f"buckets {res.stages['pull'].items:>4} unverified {res.unverified_bytes:>10,}")  # fmt: skip


if __name__ == "__main__":
    main()
