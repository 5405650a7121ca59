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
- ``glm``: GLM-5 (zai-org/GLM-5 config.json, 744 B parameters: 78 layers, the first 3 dense, hidden 6,144,
  MLA with q LoRA 2,048 / kv LoRA 512, 64 heads of 192 + 64 (rope) / 256 (values), 256 experts of 2,048 and
  one shared, vocabulary 154,880; the DSA indexer's ≈ 0.7 B parameters and the MTP layer are left out: the
  layout tables have neither). Trainer: Megatron-core TE, TP 1 × EP 8 × PP 8 = 64 GPUs (attention replicated
  over the 8 EP ranks of a stage); inference: one vLLM engine of 32 GPUs, EP 32 with attention TP 32.
- ``fp8`` (kimi, dsv3, glm): the trainer publishes its linear weights as ``fp8_block128`` pairs and the
  receivers hold them so (``_sim_quant``).
- ``flat``: ``tensors`` 1-D float32 tensors of ``numel + i % 7`` elements (``tests/transports/_nixl_peer``'s
  model, which ``bench/fanout_bench.py`` refits), one trainer rank, receivers that hold all of it: the
  calibration runs and the tests.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import refitflow as rf
from refitflow.layouts import ModelDims, Parallel, fused, megatron
from refitflow.layouts.canonical import canonical_shapes
from refitflow.layouts.wire import layout_metadata

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _sim_quant import fp8_landing, spec, trainer_shards
from _sim_traffic import Setup
from kimi_plan_bench import kimi_k2

from refitflow.refit.destination import ApplyMode, Destination

__all__ = ["dsv3", "flat", "glm", "kimi"]


def deepseek_v3(layers: int = 61, experts: int = 256) -> ModelDims:
    """DeepSeek-V3's shapes (deepseek-ai/DeepSeek-V3 config.json; the MTP layer left out)."""
    return ModelDims(
        vocab=129280, hidden=7168, layers=layers, heads=128, kv_heads=128, head_dim=128, ffn=18432,
        dense_layers=min(3, layers), experts=experts, expert_ffn=2048, shared_ffn=2048, router_bias=True,
        q_lora_rank=1536, kv_lora_rank=512, rope_dim=64, v_head_dim=128,
    )  # fmt: skip


def glm5(layers: int = 78, experts: int = 256) -> ModelDims:
    """GLM-5's shapes (zai-org/GLM-5 config.json; the DSA indexer and the MTP layer left out)."""
    return ModelDims(
        vocab=154880, hidden=6144, layers=layers, heads=64, kv_heads=64, head_dim=192, ffn=12288,
        dense_layers=min(3, layers), experts=experts, expert_ffn=2048, shared_ffn=2048, router_bias=True,
        q_lora_rank=2048, kv_lora_rank=512, rope_dim=64, v_head_dim=256,
    )  # fmt: skip


def megatron_publication(
    d: ModelDims, model: str, *, tp: int, ep: int, pp: int, pp_layers: tuple[int, ...], fp8: bool = False
) -> rf.Publication:
    """Megatron-core TE, grouped experts, expert TP 1, TP and EP folded on max(tp, ep) ranks per stage;
    ``fp8``: linear weights published as ``fp8_block128`` pairs (``_sim_quant``)."""
    ident = rf.Identity(model=model, layout="megatron")
    per = max(tp, ep)
    manifests = []
    options = {"experts": "grouped", "pp_layers": list(pp_layers)}
    for s in range(pp):
        for r in range(per):
            par = Parallel(tp=tp, tp_rank=r % tp, ep=ep, ep_rank=r % ep, expert_tp=1, pp=pp, pp_rank=s)
            meta = layout_metadata("megatron", d, par, **options)
            layout = megatron.layout(d, par, experts="grouped", pp_layers=pp_layers)
            shards, meta = trainer_shards(layout, meta, fp8)
            rank = s * per + r
            src = rf.SourceAddress(transport="loopback", agent=f"trainer-{rank}")
            manifests.append(rf.Manifest(identity=ident, version=1, rank=rank, world_size=pp * per, source=src,
                                         shards=shards, metadata=meta))  # fmt: skip
    return rf.Publication(identity=ident, version=1, manifests=tuple(manifests))


def _vllm(d: ModelDims, tp: int, ep_over_tp: bool, fp8: bool = False) -> object:
    shapes = canonical_shapes(d)

    def landing(r: int) -> Destination:
        par = fused.parallel(tp=tp, tp_rank=r, expert_parallel=ep_over_tp)
        layout = fused.layout(d, par)
        return Destination(fp8_landing(layout, shapes, fp8), ApplyMode.IN_PLACE, layout)

    return landing


def _dtype(fp8: bool) -> str:
    return "FP8 (fp8_block128 linear weights)" if fp8 else "bf16"


def kimi(layers: int = 61, experts: int = 384, engines: int = 8, fp8: bool = False) -> Setup:
    d = kimi_k2(layers, experts)
    stages = _split(layers, 8)
    pub = megatron_publication(d, "kimi-k2", tp=8, ep=32, pp=8, pp_layers=stages, fp8=fp8)
    note = (f"Kimi-K2 {layers} layers x {experts} experts, {_dtype(fp8)}; trainer Megatron TP8 x EP32 (folded) x PP8 "
            f"= 256 GPUs {stages}; {engines} vLLM engines EP16 (attention TP16) = {engines * 16} GPUs")  # fmt: skip
    return Setup("kimi-fp8" if fp8 else "kimi", pub, engines, 16, _vllm(d, 16, True, fp8), note=note)  # type: ignore[arg-type]


def dsv3(layers: int = 61, experts: int = 256, engines: int = 8, fp8: bool = False) -> Setup:
    d = deepseek_v3(layers, experts)
    stages = _split(layers, 16)
    pub = megatron_publication(d, "deepseek-v3", tp=1, ep=16, pp=16, pp_layers=stages, fp8=fp8)
    note = (f"DeepSeek-V3 {layers} layers x {experts} experts, {_dtype(fp8)}; trainer Megatron PP16 x EP16 (TP1) = "
            f"256 GPUs {stages}; {engines} vLLM engines TP32 (experts EP32) = {engines * 32} GPUs")  # fmt: skip
    return Setup("dsv3-fp8" if fp8 else "dsv3", pub, engines, 32, _vllm(d, 32, True, fp8), note=note)  # type: ignore[arg-type]


def glm(layers: int = 78, experts: int = 256, engines: int = 1, fp8: bool = False) -> Setup:
    d = glm5(layers, experts)
    stages = _split(layers, 8)
    pub = megatron_publication(d, "glm-5", tp=1, ep=8, pp=8, pp_layers=stages, fp8=fp8)
    note = (f"GLM-5 {layers} layers x {experts} experts, {_dtype(fp8)}; trainer Megatron PP8 x EP8 (TP1) = 64 GPUs "
            f"{stages}; {engines} vLLM engine(s) EP32 (attention TP32) = {engines * 32} GPUs")  # fmt: skip
    return Setup("glm-fp8" if fp8 else "glm", pub, engines, 32, _vllm(d, 32, True, fp8), note=note)  # type: ignore[arg-type]


def _split(layers: int, pp: int) -> tuple[int, ...]:
    """Layers per stage: as even as can be, the shorter stages last (first and last hold embedding, head)."""
    base, extra = divmod(layers, pp)
    return tuple(base + (s < extra) for s in range(pp))


def flat(tensors: int = 64, numel: int = 250_000, receivers: int = 1, name: str = "flat") -> Setup:
    """``tensors`` float32 1-D tensors (``_nixl_peer.model``'s sizes) on one trainer rank; ``receivers``
    engines of one rank each, holding every tensor."""
    shapes = {f"layers.{i}.weight": (numel + i % 7,) for i in range(tensors)}
    ident = rf.Identity(model=name)
    shards = tuple(spec(n, s, "float32", 4) for n, s in shapes.items())
    src = rf.SourceAddress(transport="loopback", agent="trainer-0")
    man = rf.Manifest(identity=ident, version=1, rank=0, world_size=1, source=src, shards=shards)
    pub = rf.Publication(identity=ident, version=1, manifests=(man,))

    def landing(r: int) -> Destination:
        return Destination({n: torch.empty(s, dtype=torch.float32, device="meta") for n, s in shapes.items()},
                           ApplyMode.IN_PLACE)  # fmt: skip

    note = f"{tensors} float32 tensors, {pub.nbytes / 1e6:.1f} MB, one trainer rank, {receivers} receivers"
    return Setup(name, pub, receivers, 1, landing, note=note)
