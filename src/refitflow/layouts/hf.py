"""HF transformers-5 layout (TP 1): plain names, MoE experts fused as 3-D ``gate_up_proj``/``down_proj``.

``LEGACY_EXPERTS`` maps the older per-expert ``experts.N.w1/w2/w3`` names onto the same canonical tensors.
"""

from __future__ import annotations

from typing import Any

from refitflow.layouts.canonical import LayoutMap, ModelDims, canonical_shapes
from refitflow.layouts.rules import Parallel, Table, build

__all__ = ["LEGACY_EXPERTS", "dims_from_config", "layout"]

_PLAIN = ("mlp.experts.gate", "mlp.experts.up", "mlp.experts.down")
_EXPERTS: Table = {
    "mlp.experts.gate_up_proj": ("experts_col", ("mlp.experts.gate", "mlp.experts.up")),
    "mlp.experts.down_proj": ("experts_row", ("mlp.experts.down",)),
}
LEGACY_EXPERTS: Table = {
    "block_sparse_moe.experts.{j}.w1.weight": ("expert_col", ("mlp.experts.gate",)),
    "block_sparse_moe.experts.{j}.w3.weight": ("expert_col", ("mlp.experts.up",)),
    "block_sparse_moe.experts.{j}.w2.weight": ("expert_row", ("mlp.experts.down",)),
}


def layout(d: ModelDims, *, legacy_experts: bool = False) -> LayoutMap:
    shapes = canonical_shapes(d)
    top: Table = {n: ("rep", (n,)) for n in shapes if not n.startswith("model.layers.")}
    layer: Table = {}
    for n in shapes:
        if n.startswith("model.layers.0."):
            suffix = n.removeprefix("model.layers.0.")
            if suffix not in _PLAIN:
                layer[suffix] = ("rep", (suffix,))
    layer |= LEGACY_EXPERTS if legacy_experts else _EXPERTS
    return build(top, layer, "model.layers", d, Parallel())


def dims_from_config(c: Any) -> ModelDims:
    """ModelDims from a transformers config (Llama, Qwen2, Qwen3, Mixtral), read by attribute."""
    heads = c.num_attention_heads
    experts = getattr(c, "num_local_experts", 0) or 0
    return ModelDims(
        vocab=c.vocab_size, hidden=c.hidden_size, layers=c.num_hidden_layers, heads=heads,
        kv_heads=getattr(c, "num_key_value_heads", None) or heads,
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
        ffn=0 if experts else c.intermediate_size, experts=experts,
        expert_ffn=c.intermediate_size if experts else 0,
        qkv_bias=c.model_type == "qwen2" or bool(getattr(c, "attention_bias", False)),
        qk_norm=c.model_type in ("qwen3", "qwen3_moe"), tied=bool(getattr(c, "tie_word_embeddings", False)),
    )  # fmt: skip
