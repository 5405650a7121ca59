"""Fused inference layout (vLLM-style, receiver side): any TP, EP for experts.

vLLM pads the vocabulary of ``VocabParallelEmbedding`` / ``ParallelLMHead`` to a multiple of 64
(``DEFAULT_VOCAB_PADDING_SIZE``) and splits the padded rows evenly over TP; the padding rows map to nothing.
"""

from __future__ import annotations

from refitflow.layouts.canonical import LayoutMap, ModelDims
from refitflow.layouts.rules import Parallel, Table, build, pad

__all__ = ["LAYER", "TOP", "VOCAB_PADDING", "layout", "padded_vocab"]

VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE

TOP: Table = {
    "model.embed_tokens.weight": ("vocab", ("model.embed_tokens.weight",)),
    "lm_head.weight": ("vocab", ("lm_head.weight",)),
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


def padded_vocab(vocab: int, vocab_padding: int = VOCAB_PADDING) -> int:
    """The rows of vLLM's padded embedding (before the TP split): ``vocab`` rounded up to ``vocab_padding``."""
    return pad(vocab, vocab_padding)


def layout(d: ModelDims, par: Parallel, *, vocab_padding: int = VOCAB_PADDING) -> LayoutMap:
    """This rank's vLLM parameters; ``vocab_padding`` is the model's ``padding_size`` (1: no padding)."""
    return build(TOP, LAYER, "model.layers", d, par, vocab_rows=padded_vocab(d.vocab, vocab_padding))
