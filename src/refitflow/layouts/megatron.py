"""Megatron-core GPT layout (publisher side): TP, EP (expert TP 1 by default), fused interleaved QKV."""

from __future__ import annotations

from refitflow.layouts.canonical import LayoutMap, ModelDims
from refitflow.layouts.rules import Parallel, Table, build

__all__ = ["LAYER", "TOP", "layout"]

TOP: Table = {
    "embedding.word_embeddings.weight": ("col", ("model.embed_tokens.weight",)),
    "output_layer.weight": ("col", ("lm_head.weight",)),
    "decoder.final_layernorm.weight": ("rep", ("model.norm.weight",)),
}
_QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
LAYER: Table = {
    "input_layernorm.weight": ("rep", ("input_layernorm.weight",)),
    "pre_mlp_layernorm.weight": ("rep", ("post_attention_layernorm.weight",)),
    "self_attention.linear_qkv.weight": ("qkv_grouped", tuple(n + ".weight" for n in _QKV)),
    "self_attention.linear_qkv.bias": ("qkv_grouped", tuple(n + ".bias" for n in _QKV)),
    "self_attention.q_layernorm.weight": ("rep", ("self_attn.q_norm.weight",)),
    "self_attention.k_layernorm.weight": ("rep", ("self_attn.k_norm.weight",)),
    "self_attention.linear_proj.weight": ("row", ("self_attn.o_proj.weight",)),
    "mlp.linear_fc1.weight": ("col", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
    "mlp.linear_fc2.weight": ("row", ("mlp.down_proj.weight",)),
    "mlp.router.weight": ("rep", ("mlp.gate.weight",)),
    "mlp.experts.local_experts.{j}.linear_fc1.weight": ("expert_col", ("mlp.experts.gate", "mlp.experts.up")),
    "mlp.experts.local_experts.{j}.linear_fc2.weight": ("expert_row", ("mlp.experts.down",)),
}


def layout(d: ModelDims, par: Parallel) -> LayoutMap:
    """This rank's Megatron parameters; experts are not tensor-parallel unless ``par.expert_tp`` says so."""
    if par.expert_tp is None:
        par = Parallel(tp=par.tp, tp_rank=par.tp_rank, ep=par.ep, ep_rank=par.ep_rank, expert_tp=1)
    return build(TOP, LAYER, "decoder.layers", d, par)
