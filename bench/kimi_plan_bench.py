"""Planning time for a Kimi-K2-shaped model: a Megatron trainer at EP 8 into vLLM ranks at EP 16.

    python bench/kimi_plan_bench.py [--layers 61] [--experts 384] [--receiver tp16|dp16|tp8xdp8] [--ranks 0,15]
        [--train-tp 8] [--train-ep 8] [--train-pp 1] [--digests] [--apart]

No weights: the trainer's shards are shape-only ``ShardSpec``s (block digests of the publisher's block
sizes, zero bytes) and the receiver's parameters are meta tensors, so a 1-T-parameter model plans in
little memory. Trainer: Megatron-core TE names, grouped experts, TP 8 × EP 8 folded on 8 ranks
(expert TP 1: rank r holds attention slice r and experts 48r..48r+47), in each of ``--train-pp`` pipeline
stages; its memory two DDP buffers laid out last parameter first, as Megatron's are (``--apart``: each
tensor its own registration). Receivers: vLLM, experts on EP ranks (expert TP 1): ``tpN`` attention TP N (EP N), ``dpN``
attention data-parallel (TP 1 × DP N, EP N), ``tpAxdpB`` both (EP A × B). For each receiver rank asked
for it (default: the first and the last) it prints the time to build its plan (what its first read waits
for; "+ checks": what verify and commit need of each bucket, made as the plan stage hands the buckets on,
while earlier ones are read) — each rank resolves the part of the trainer layouts it reads, as its own
process does on its first refit; the first plan in this process also fills caches of shapes shared by
every rank ("first") — the box copies, buckets, reads and bytes, against the bytes of its slice.
``--digests``: also the seconds a rank decodes a version's digests in (``Plan.digests``: those of the shards
it reads), and for comparison every shard's (what each rank decoded before stop 45), best of 3.

``--control [--versions 3] [--engines 8] [--baseline COMMIT]``: instead, a version's control traffic through the
real registry service and the real receiver code — the registry's work to accept a version, the bytes and
seconds each receiver rank asked for needs to fetch and decode it, the registry's egress for ``--engines``
engines (``bench/_kimi_control.py``). The simulator's Kimi-K2 trainer: ``--train-ep 32 --train-pp 8``.
"""

from __future__ import annotations

import argparse
import base64
import math
import re
import time

import torch

import refitflow as rf
from refitflow.core.digests import Tiling, choose_tiling
from refitflow.layouts import ModelDims, Parallel, fused, megatron
from refitflow.layouts.wire import layout_metadata

try:
    from refitflow.planner import Plan, build_plan

    try:
        from refitflow.planner.vector import digest_vector
    except ImportError:  # a tree before planner/vector.py
        from refitflow.planner.checks import digest_vector  # type: ignore[attr-defined,no-redef]
    from refitflow.refit.config import ReceiverConfig
    from refitflow.refit.destination import ApplyMode, Destination
except ImportError:  # a tree before planner/ and refit/ (``--control --baseline``)
    from refitflow.pipeline.config import ReceiverConfig  # type: ignore[no-redef]
    from refitflow.pipeline.destination import ApplyMode, Destination  # type: ignore[no-redef]
    from refitflow.stages._checks import digest_vector  # type: ignore[no-redef]
    from refitflow.stages.plan import Plan, build_plan  # type: ignore[no-redef]


def kimi_k2(layers: int, experts: int) -> ModelDims:
    """Kimi-K2's shapes (moonshotai/Kimi-K2-Instruct config.json), with ``layers`` and ``experts`` adjustable."""
    return ModelDims(
        vocab=163840, hidden=7168, layers=layers, heads=64, kv_heads=64, head_dim=128, ffn=18432, dense_layers=1,
        experts=experts, expert_ffn=2048, shared_ffn=2048, router_bias=True, q_lora_rank=1536, kv_lora_rank=512,
        rope_dim=64, v_head_dim=128,
    )  # fmt: skip


def _spec(name: str, shape: tuple[int, ...], region: int, offset: int, algo: str = "xxh3") -> rf.ShardSpec:
    """A shape-only bf16 shard at ``offset`` of ``region``: the publisher's tile geometry, zero digests, no bytes."""
    rows, cols = choose_tiling(shape, 2)
    blocks = base64.b64encode(bytes(8 * Tiling(algo, shape, 2, rows, cols).count)).decode()
    return rf.ShardSpec(
        name=name, dtype="bfloat16", global_shape=shape, axis=None, start=0, stop=shape[0] if shape else 1,
        digest="0" * 16, region=region, offset=offset, algo=algo, tile_rows=rows, tile_cols=cols, blocks=blocks,
    )  # fmt: skip


def memory(shapes: dict[str, tuple[int, ...]], apart: bool) -> dict[str, tuple[int, int]]:
    """Where a Megatron rank holds each tensor, (region, byte offset): two DDP buffers (dense parameters,
    expert parameters), each laid out last parameter first, each start padded to 64 elements (Megatron's
    distributed optimizer), the publisher registering each buffer once; ``apart``: each tensor its own
    region (a trainer without DDP buffers)."""
    if apart:
        return {n: (k, 0) for k, n in enumerate(shapes)}
    out, ends = {}, [0, 0]
    for n in reversed(shapes):
        region = int(".mlp.experts." in n)
        out[n] = (region, ends[region])
        ends[region] += -(-math.prod(shapes[n]) // 64) * 64 * 2
    return out


def publication(d: ModelDims, tp: int, ep: int, pp: int = 1, apart: bool = False) -> tuple[rf.Publication, float]:
    """The trainer's publication (shape-only) and the seconds its layouts took to build: ``pp`` pipeline stages
    (the first ones a layer more when they do not divide the layers), each of ``max(tp, ep)`` ranks, its
    memory as ``memory`` lays it out."""
    ident = rf.Identity(model="kimi-k2", layout="megatron")
    manifests, seconds = [], 0.0
    world = max(tp, ep)
    per, extra = divmod(d.layers, pp)
    stages = tuple(per + (p < extra) for p in range(pp))
    options = {"experts": "grouped"} | ({"pp_layers": stages} if pp > 1 else {})
    for p in range(pp):
        for r in range(world):
            par = Parallel(tp=tp, tp_rank=r % tp, ep=ep, ep_rank=r % ep, expert_tp=1, pp=pp, pp_rank=p)
            t0 = time.perf_counter()
            meta = layout_metadata("megatron", d, par, **options)
            layout = megatron.layout(d, par, **options)  # type: ignore[arg-type]
            seconds += time.perf_counter() - t0
            where = memory({n: lt.shape for n, lt in layout.items()}, apart)
            shards = tuple(_spec(n, lt.shape, *where[n]) for n, lt in layout.items())
            rank = p * world + r
            src = rf.SourceAddress(transport="loopback", agent=f"trainer-{rank}")
            manifests.append(rf.Manifest(identity=ident, version=1, rank=rank, world_size=world * pp, source=src,
                                         shards=shards, metadata=meta))  # fmt: skip
    return rf.Publication(identity=ident, version=1, manifests=tuple(manifests)), seconds


def _best(f: object, *args: object) -> float:
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        f(*args)  # type: ignore[operator]
        times.append(time.perf_counter() - t0)
    return min(times)


def digests(pub: rf.Publication, plan: Plan) -> str:
    """A rank's digest decode per version, against every shard's (``--digests``: trees of stop 45 on)."""
    from refitflow.planner.vector import every_shard

    every, count = every_shard(pub)
    mine, whole = _best(plan.digests, pub), _best(digest_vector, pub, every, count)
    return f"; digests a version {mine:.2f} s ({plan.digest_count:,} of {count:,}; every shard's {whole:.2f} s)"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--experts", type=int, default=384)
    ap.add_argument("--train-tp", type=int, default=8)
    ap.add_argument("--train-ep", type=int, default=8)
    ap.add_argument("--train-pp", type=int, default=1, help="pipeline stages of the trainer")
    ap.add_argument("--receiver", default="tp16", help="tpN, dpN or tpAxdpB: vLLM's attention TP and DP (EP: TP x DP)")
    ap.add_argument("--ranks", default=None, help="receiver ranks to plan (default: the first and the last)")
    ap.add_argument("--digests", action="store_true", help="time each rank's digest decode per version too")
    ap.add_argument("--apart", action="store_true", help="each trainer tensor its own region (no DDP buffers)")
    ap.add_argument("--control", action="store_true", help="measure a version's control traffic instead")
    ap.add_argument("--versions", type=int, default=3, help="--control: versions published")
    ap.add_argument("--engines", type=int, default=8, help="--control: engines the egress is counted for")
    ap.add_argument("--baseline", default="", help="--control: an earlier refitflow (a git commit) to run first")
    ap.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    shape = re.fullmatch(r"(?:tp(\d+))?x?(?:dp(\d+))?", a.receiver)
    if shape is None or not any(shape.groups()):
        ap.error(f"--receiver: tpN, dpN or tpAxdpB, got {a.receiver!r}")
    rtp, rdp = (int(g) if g else 1 for g in shape.groups())
    ranks = [int(x) for x in a.ranks.split(",")] if a.ranks else [0, rtp * rdp - 1]
    if a.control:
        from _kimi_control import run

        a.rank_list, a.rtp, a.rdp = ranks, rtp, rdp
        run(a)
        return
    d = kimi_k2(a.layers, a.experts)
    t0 = time.perf_counter()
    pub, layout_s = publication(d, a.train_tp, a.train_ep, a.train_pp, a.apart)
    shards = sum(len(m.shards) for m in pub.manifests)
    print(f"Kimi-K2 shape: {d.layers} layers, {d.experts} experts, {pub.nbytes / 1e12:.2f} TB bf16; "
          f"trainer Megatron TE grouped TP {a.train_tp} x EP {a.train_ep} (expert TP 1) x PP {a.train_pp}"
          f"{', each tensor apart' if a.apart else ', DDP buffers'}: "
          f"{len(pub.manifests)} "
          f"ranks, {shards:,} shards; publication built in {time.perf_counter() - t0:.1f} s "
          f"(trainer layouts {layout_s:.1f} s)")  # fmt: skip
    limits = ReceiverConfig().limits
    for r in ranks:
        par = fused.parallel(tp=rtp, tp_rank=r % rtp, dp=rdp, dp_rank=r // rtp, expert_parallel=True)
        t0 = time.perf_counter()
        layout = fused.layout(d, par)
        layout_s = time.perf_counter() - t0
        params = {n: torch.empty(lt.shape, dtype=torch.bfloat16, device="meta") for n, lt in layout.items()}
        dest = Destination(params, ApplyMode.IN_PLACE, layout)
        first = r == ranks[0]
        t0 = time.perf_counter()
        plan = build_plan(pub, dest, limits)
        plan_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        for b in plan.buckets:  # what the plan stage makes as it hands the buckets on, while reads go
            if hasattr(b, "built"):  # (trees before stop 45 made them in the plan: "+ checks 0.00")
                b.built()
        checks_s = time.perf_counter() - t0
        reads = sum(len(b.reads) for b in plan.buckets)
        copies = sum(len(p.scatters) for b in plan.buckets for p in b.pieces)
        print(f"vLLM EP {rtp * rdp} {a.receiver} rank {r:>2}: {len(layout):>5} params, layout {layout_s * 1e3:.1f} ms, "
              f"plan {plan_s:6.2f} s{' (first)' if first else ''} + checks {checks_s:.2f} s; "
              f"{copies:>6,} box copies, {len(plan.buckets):>5} buckets, {reads:>7,} reads, "
              f"{plan.nbytes / 1e9:6.2f} GB pulled for a {plan.ideal_bytes / 1e9:6.2f} GB slice"
              f"{digests(pub, plan) if a.digests else ''}")  # fmt: skip


if __name__ == "__main__":
    main()
