"""Fused inference layout (vLLM 0.33 names, receiver side): any TP, EP for experts.

Names as vLLM's models hold them: ``qkv_proj`` (``[q; k; v]`` of this rank's heads), ``gate_up_proj``,
the experts stacked as ``experts.routed_experts.w13_weight`` (this EP rank's experts, ``[gate; up]``
expert-TP sliced) and ``experts.routed_experts.w2_weight`` (vLLM ≥ 0.32 holds them in the ``FusedMoE``
layer's ``RoutedExperts`` child; SGLang keeps them on the layer: ``experts.w13_weight``), the router
``gate.weight`` / ``gate.e_score_correction_bias``,
``shared_experts.gate_up_proj``/``down_proj`` (TP-split). Latent attention (DeepSeek-V2/V3, Kimi-K2,
``deepseek_v2.py``): ``fused_qkv_a_proj`` = ``[q_a_proj; kv_a_proj_with_mqa]`` replicated,
``q_a_layernorm``, ``q_b_proj`` (TP by heads), ``kv_a_layernorm``, ``kv_b_proj`` (TP by heads),
``o_proj``; without a q LoRA rank, ``q_proj`` (TP) and ``kv_a_proj_with_mqa`` (replicated).
Mixtral keeps its MoE block as ``block_sparse_moe`` (``moe_module=``; ``layout_for`` reads it from
the config).

vLLM pads the vocabulary of ``VocabParallelEmbedding`` / ``ParallelLMHead`` to a multiple of 64
(``DEFAULT_VOCAB_PADDING_SIZE``) and splits the padded rows evenly over TP; the padding rows map to nothing.

Pipeline parallel (``par.pp``): layers keep their global index; the split is vLLM's ``get_pp_indices``
(even, the remainder one each on the stages before the last) unless ``pp_layers`` gives it
(``VLLM_PP_LAYER_PARTITION``); embeddings on the first stage, the final norm and LM head on the last.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from refitflow.layouts.canonical import LayoutMap, ModelDims
from refitflow.layouts.hf import dims_from_config
from refitflow.layouts.rules import Parallel, Table, Tables, build, pad

__all__ = [
    "MOE_MODULE",
    "VOCAB_PADDING",
    "build_fused",
    "layout",
    "layout_for",
    "padded_vocab",
    "parallel",
    "pp_split",
    "tables",
]

VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE
MOE_MODULE = {"mixtral": "block_sparse_moe"}  # model_type -> the MoE block's name, where it is not "mlp"

_A = "self_attn."
_QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
FIRST: Table = {"model.embed_tokens.weight": ("vocab", ("model.embed_tokens.weight",))}
LAST: Table = {
    "lm_head.weight": ("vocab", ("lm_head.weight",)),
    "model.norm.weight": ("rep", ("model.norm.weight",)),
}
LAYER: Table = {
    "input_layernorm.weight": ("rep", ("input_layernorm.weight",)),
    "post_attention_layernorm.weight": ("rep", ("post_attention_layernorm.weight",)),
}
ATTENTION: Table = {
    _A + "qkv_proj.weight": ("qkv_flat", tuple(n + ".weight" for n in _QKV)),
    _A + "qkv_proj.bias": ("qkv_flat", tuple(n + ".bias" for n in _QKV)),
    _A + "q_norm.weight": ("rep", ("self_attn.q_norm.weight",)),
    _A + "k_norm.weight": ("rep", ("self_attn.k_norm.weight",)),
    _A + "o_proj.weight": ("row", ("self_attn.o_proj.weight",)),
}
_MLA: Table = {
    _A + "kv_a_layernorm.weight": ("rep", ("self_attn.kv_a_layernorm.weight",)),
    _A + "kv_b_proj.weight": ("col", ("self_attn.kv_b_proj.weight",)),
    _A + "o_proj.weight": ("row", ("self_attn.o_proj.weight",)),
}
MLA_Q_LORA: Table = _MLA | {
    _A + "fused_qkv_a_proj.weight": ("rep", ("self_attn.q_a_proj.weight", "self_attn.kv_a_proj_with_mqa.weight")),
    _A + "q_a_layernorm.weight": ("rep", ("self_attn.q_a_layernorm.weight",)),
    _A + "q_b_proj.weight": ("col", ("self_attn.q_b_proj.weight",)),
}
MLA_Q_PROJ: Table = _MLA | {
    _A + "q_proj.weight": ("col", ("self_attn.q_proj.weight",)),
    _A + "kv_a_proj_with_mqa.weight": ("rep", ("self_attn.kv_a_proj_with_mqa.weight",)),
}
DENSE: Table = {
    "mlp.gate_up_proj.weight": ("col", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
    "mlp.down_proj.weight": ("row", ("mlp.down_proj.weight",)),
}
MOE: Table = {
    "mlp.gate.weight": ("rep", ("mlp.gate.weight",)),
    "mlp.gate.e_score_correction_bias": ("rep", ("mlp.gate.e_score_correction_bias",)),
    "mlp.experts.w13_weight": ("experts_col", ("mlp.experts.gate", "mlp.experts.up")),
    "mlp.experts.w2_weight": ("experts_row", ("mlp.experts.down",)),
    "mlp.shared_experts.gate_up_proj.weight": (
        "col", ("mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight")
    ),
    "mlp.shared_experts.down_proj.weight": ("row", ("mlp.shared_experts.down_proj.weight",)),
}  # fmt: skip


ROUTED = "routed_experts."  # vLLM's FusedMoE holds its expert weights in a RoutedExperts child


def tables(d: ModelDims, *, moe_module: str = "mlp", mla_q_lora: Table = MLA_Q_LORA, routed: str = ROUTED) -> Tables:
    """The fused tables for this model (``moe_module``: the MoE block's name; ``mla_q_lora`` and ``routed``,
    the experts' holder: SGLang's names differ)."""
    moe = {k.replace("mlp.", moe_module + ".", 1).replace("experts.w", f"experts.{routed}w"): v for k, v in MOE.items()}
    mla = mla_q_lora if d.q_lora_rank else MLA_Q_PROJ
    return Tables(first=FIRST, last=LAST, layer=LAYER, attention=ATTENTION, mla=mla, dense=DENSE, moe=moe)


def padded_vocab(vocab: int, vocab_padding: int = VOCAB_PADDING) -> int:
    """The rows of vLLM's padded embedding (before the TP split): ``vocab`` rounded up to ``vocab_padding``."""
    return pad(vocab, vocab_padding)


def pp_split(layers: int, pp: int) -> tuple[int, ...]:
    """vLLM's layers per pipeline stage (``get_pp_indices``): even, the remainder one each on the stages
    before the last, counting back from the second-to-last."""
    stages = [layers // pp] * pp
    for i in range(2, layers % pp + 2):
        stages[-i] += 1
    return tuple(stages)


def layout(
    d: ModelDims,
    par: Parallel,
    *,
    vocab_padding: int = VOCAB_PADDING,
    moe_module: str = "mlp",
    pp_layers: tuple[int, ...] | list[int] | None = None,
) -> LayoutMap:
    """This rank's vLLM parameters; ``vocab_padding`` is the model's ``padding_size`` (1: no padding)."""
    return build_fused(tables(d, moe_module=moe_module), d, par, padded_vocab(d.vocab, vocab_padding), pp_layers)


def build_fused(
    t: Tables, d: ModelDims, par: Parallel, vocab_rows: int, pp_layers: tuple[int, ...] | list[int] | None
) -> LayoutMap:
    """A fused-names layout (vLLM, SGLang): global layer numbers, vLLM's stage split unless given."""
    stages = pp_split(d.layers, par.pp) if pp_layers is None else tuple(pp_layers)
    return build(t, "model.layers", d, par, vocab_rows=vocab_rows, stages=stages)


def parallel(
    *,
    tp: int,
    tp_rank: int,
    dp: int = 1,
    dp_rank: int = 0,
    expert_parallel: bool = False,
    pp: int = 1,
    pp_rank: int = 0,
) -> Parallel:
    """A vLLM worker's place (``FusedMoEParallelConfig.make``): attention, dense MLPs and the vocabulary
    are split over ``tp``; the experts over ``tp × dp`` ranks — tensor-parallel without expert
    parallelism, whole experts (expert TP 1) with it; layers over ``pp`` stages."""
    flat, rank = tp * dp, dp_rank * tp + tp_rank
    stage = {"pp": pp, "pp_rank": pp_rank}
    if expert_parallel and flat > 1:
        return Parallel(tp=tp, tp_rank=tp_rank, ep=flat, ep_rank=rank, expert_tp=1, **stage)
    return Parallel(tp=tp, tp_rank=tp_rank, expert_tp=flat, expert_tp_rank=rank, **stage)


def layout_for(
    config: Any, par: Parallel, *, vocab_padding: int = VOCAB_PADDING, make: Callable[..., LayoutMap] = layout
) -> LayoutMap:
    """The fused layout of a vLLM model from its HF config (``model_config.hf_config``) and place
    (``make``: ``sglang.layout`` for SGLang's names)."""
    moe_module = MOE_MODULE.get(config.model_type, "mlp")
    return make(dims_from_config(config), par, vocab_padding=vocab_padding, moe_module=moe_module)
