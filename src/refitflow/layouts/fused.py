"""Fused inference layout (vLLM-style, receiver side): any TP, EP for experts."""

from __future__ import annotations

from refitflow.layouts.canonical import LayoutMap, ModelDims
from refitflow.layouts.rules import Parallel, Table, build

__all__ = ["LAYER", "TOP", "layout"]

TOP: Table = {
    "model.embed_tokens.weight": ("col", ("model.embed_tokens.weight",)),
    "lm_head.weight": ("col", ("lm_head.weight",)),
    "model.norm.weight": ("rep", ("model.norm.weight",)),
}
_QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
LAYER: Table = {
    "input_layernorm.weight": ("rep", ("input_layernorm.weight",)),
    "post_attention_layernorm.weight": ("rep", ("post_attention_layernorm.weight",)),
    "self_attn.qkv_proj.weight": ("qkv_flat", tuple(n + ".weight" for n in _QKV)),
    "self_attn.qkv_proj.bias": ("qkv_flat", tuple(n + ".bias" for n in _QKV)),
    "self_attn.q_norm.weight": ("rep", ("self_attn.q_norm.weight",)),
    "self_attn.k_norm.weight": ("rep", ("self_attn.k_norm.weight",)),
    "self_attn.o_proj.weight": ("row", ("self_attn.o_proj.weight",)),
    "mlp.gate_up_proj.weight": ("col", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
    "mlp.down_proj.weight": ("row", ("mlp.down_proj.weight",)),
    "mlp.gate.weight": ("rep", ("mlp.gate.weight",)),
    "mlp.experts.w13_weight": ("experts_col", ("mlp.experts.gate", "mlp.experts.up")),
    "mlp.experts.w2_weight": ("experts_row", ("mlp.experts.down",)),
}


def layout(d: ModelDims, par: Parallel) -> LayoutMap:
    return build(TOP, LAYER, "model.layers", d, par)
