"""The scenarios of ``bench/simulate.py`` as refitflow publications and receiver landings (shape only).

- ``kimi``: Kimi-K2 (moonshotai/Kimi-K2-Instruct shapes: 61 layers, 384 experts, ≈ 1.03e12 parameters,
  bf16 on the wire). Trainer: Megatron-core TE names, grouped experts, TP 8 × EP 32 folded (expert TP 1:
  attention TP 8, four copies of it among the 32 ranks of a stage) × PP 8 (8, 8, 8, 8, 8, 7, 7, 7 layers)
  = 256 GPUs. Inference: 8 vLLM engines of 16 GPUs, EP 16 with attention TP 16 (the ``tp16`` receiver of
  ``bench/kimi_plan_bench.py``) = 128 GPUs.
- ``dsv3``: DeepSeek-V3 (61 layers, 256 experts, first 3 dense). Trainer: Megatron-core TE, grouped
  experts, TP 1 × EP 16 × PP 16 (3, 4 × 13, 3, 3 layers) = 256 GPUs, attention replicated over the 16 EP
  ranks of a stage (the planner picks one replica per box, spreading its load). Inference: 8 vLLM engines
  of TP 32 (experts EP 32, attention TP 32) = 256 GPUs.
- ``flat``: ``tensors`` 1-D float32 tensors of ``numel + i % 7`` elements (``tests/transports/_nixl_peer``'s
  model, which ``bench/fanout_bench.py`` refits), one trainer rank, receivers that hold all of it: the
  calibration runs and the tests.
"""

from __future__ import annotations

import base64
import sys
from pathlib import Path

import torch

import refitflow as rf
from refitflow.core.digests import Tiling, choose_tiling
from refitflow.layouts import ModelDims, Parallel, fused, megatron
from refitflow.layouts.wire import layout_metadata

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _sim_traffic import Setup, meta_landing
from kimi_plan_bench import kimi_k2

from refitflow.refit.destination import ApplyMode, Destination

__all__ = ["dsv3", "flat", "kimi"]


def deepseek_v3(layers: int = 61, experts: int = 256) -> ModelDims:
    """DeepSeek-V3's shapes (deepseek-ai/DeepSeek-V3 config.json; the MTP layer left out)."""
    return ModelDims(
        vocab=129280, hidden=7168, layers=layers, heads=128, kv_heads=128, head_dim=128, ffn=18432,
        dense_layers=min(3, layers), experts=experts, expert_ffn=2048, shared_ffn=2048, router_bias=True,
        q_lora_rank=1536, kv_lora_rank=512, rope_dim=64, v_head_dim=128,
    )  # fmt: skip


def _spec(name: str, shape: tuple[int, ...], dtype: str, itemsize: int) -> rf.ShardSpec:
    """A shape-only shard: the publisher's tile geometry, zero digests, no bytes (as kimi_plan_bench)."""
    rows, cols = choose_tiling(shape, itemsize)
    blocks = base64.b64encode(bytes(8 * Tiling("xxh3", shape, itemsize, rows, cols).count)).decode()
    return rf.ShardSpec(
        name=name, dtype=dtype, global_shape=shape, axis=None, start=0, stop=shape[0] if shape else 1,
        digest="0" * 16, region=0, algo="xxh3", tile_rows=rows, tile_cols=cols, blocks=blocks,
    )  # fmt: skip


def megatron_publication(
    d: ModelDims, model: str, *, tp: int, ep: int, pp: int, pp_layers: tuple[int, ...]
) -> rf.Publication:
    """Megatron-core TE, grouped experts, expert TP 1, TP and EP folded on max(tp, ep) ranks per stage."""
    ident = rf.Identity(model=model, layout="megatron")
    per = max(tp, ep)
    manifests = []
    options = {"experts": "grouped", "pp_layers": list(pp_layers)}
    for s in range(pp):
        for r in range(per):
            par = Parallel(tp=tp, tp_rank=r % tp, ep=ep, ep_rank=r % ep, expert_tp=1, pp=pp, pp_rank=s)
            meta = layout_metadata("megatron", d, par, **options)
            layout = megatron.layout(d, par, experts="grouped", pp_layers=pp_layers)
            shards = tuple(_spec(n, lt.shape, "bfloat16", 2) for n, lt in layout.items())
            rank = s * per + r
            src = rf.SourceAddress(transport="loopback", agent=f"trainer-{rank}")
            manifests.append(rf.Manifest(identity=ident, version=1, rank=rank, world_size=pp * per, source=src,
                                         shards=shards, metadata=meta))  # fmt: skip
    return rf.Publication(identity=ident, version=1, manifests=tuple(manifests))


def _vllm(d: ModelDims, tp: int, ep_over_tp: bool) -> object:
    def landing(r: int) -> Destination:
        par = fused.parallel(tp=tp, tp_rank=r, expert_parallel=ep_over_tp)
        return meta_landing(fused.layout(d, par))

    return landing


def kimi(layers: int = 61, experts: int = 384, engines: int = 8) -> Setup:
    d = kimi_k2(layers, experts)
    stages = _split(layers, 8)
    pub = megatron_publication(d, "kimi-k2", tp=8, ep=32, pp=8, pp_layers=stages)
    note = (f"Kimi-K2 {layers} layers x {experts} experts; trainer Megatron TP8 x EP32 (folded) x PP8 = 256 GPUs "
            f"{stages}; {engines} vLLM engines EP16 (attention TP16) = {engines * 16} GPUs")  # fmt: skip
    return Setup("kimi", pub, engines, 16, _vllm(d, 16, True), note=note)  # type: ignore[arg-type]


def dsv3(layers: int = 61, experts: int = 256, engines: int = 8) -> Setup:
    d = deepseek_v3(layers, experts)
    stages = _split(layers, 16)
    pub = megatron_publication(d, "deepseek-v3", tp=1, ep=16, pp=16, pp_layers=stages)
    note = (f"DeepSeek-V3 {layers} layers x {experts} experts; trainer Megatron PP16 x EP16 (TP1) = 256 GPUs "
            f"{stages}; {engines} vLLM engines TP32 (experts EP32) = {engines * 32} GPUs")  # fmt: skip
    return Setup("dsv3", pub, engines, 32, _vllm(d, 32, True), note=note)  # type: ignore[arg-type]


def _split(layers: int, pp: int) -> tuple[int, ...]:
    """Layers per stage: as even as can be, the shorter stages last (first and last hold embedding, head)."""
    base, extra = divmod(layers, pp)
    return tuple(base + (s < extra) for s in range(pp))


def flat(tensors: int = 64, numel: int = 250_000, receivers: int = 1, name: str = "flat") -> Setup:
    """``tensors`` float32 1-D tensors (``_nixl_peer.model``'s sizes) on one trainer rank; ``receivers``
    engines of one rank each, holding every tensor."""
    shapes = {f"layers.{i}.weight": (numel + i % 7,) for i in range(tensors)}
    ident = rf.Identity(model=name)
    shards = tuple(_spec(n, s, "float32", 4) for n, s in shapes.items())
    src = rf.SourceAddress(transport="loopback", agent="trainer-0")
    man = rf.Manifest(identity=ident, version=1, rank=0, world_size=1, source=src, shards=shards)
    pub = rf.Publication(identity=ident, version=1, manifests=(man,))

    def landing(r: int) -> Destination:
        return Destination({n: torch.empty(s, dtype=torch.float32, device="meta") for n, s in shapes.items()},
                           ApplyMode.IN_PLACE)  # fmt: skip

    note = f"{tensors} float32 tensors, {pub.nbytes / 1e6:.1f} MB, one trainer rank, {receivers} receivers"
    return Setup(name, pub, receivers, 1, landing, note=note)
