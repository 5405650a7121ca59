"""Megatron-core GPT layout (publisher side): TP, EP (expert TP 1 by default), fused interleaved QKV.

Megatron pads the vocabulary to a multiple of ``make-vocab-size-divisible-by`` × TP (default 128 × TP):
the embedding and output layer hold the padded rows, which map to nothing.
"""

from __future__ import annotations

from refitflow.layouts.canonical import LayoutMap, ModelDims
from refitflow.layouts.rules import Parallel, Table, build, pad

__all__ = ["LAYER", "TOP", "VOCAB_DIVISIBLE_BY", "layout", "padded_vocab"]

VOCAB_DIVISIBLE_BY = 128  # Megatron's --make-vocab-size-divisible-by default

TOP: Table = {
    "embedding.word_embeddings.weight": ("vocab", ("model.embed_tokens.weight",)),
    "output_layer.weight": ("vocab", ("lm_head.weight",)),
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


def padded_vocab(vocab: int, tp: int, vocab_divisible_by: int = VOCAB_DIVISIBLE_BY) -> int:
    """The rows of Megatron's padded embedding: ``vocab`` rounded up to ``vocab_divisible_by`` × ``tp``."""
    return pad(vocab, vocab_divisible_by * tp)


def layout(d: ModelDims, par: Parallel, *, vocab_divisible_by: int = VOCAB_DIVISIBLE_BY) -> LayoutMap:
    """This rank's Megatron parameters; experts are not tensor-parallel unless ``par.expert_tp`` says so."""
    if par.expert_tp is None:
        par = Parallel(tp=par.tp, tp_rank=par.tp_rank, ep=par.ep, ep_rank=par.ep_rank, expert_tp=1)
    rows = padded_vocab(d.vocab, par.tp, vocab_divisible_by)
    return build(TOP, LAYER, "decoder.layers", d, par, vocab_rows=rows)
