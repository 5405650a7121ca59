"""HF transformers-5 layout (TP 1): canonical names, MoE experts fused as 3-D ``gate_up_proj``/``down_proj``.

``EXPERTS`` also maps the per-expert names of checkpoints onto the same canonical tensors: Mixtral's
``block_sparse_moe.experts.N.w1/w2/w3`` and DeepSeek / Qwen-MoE's ``mlp.experts.N.{gate,up,down}_proj``.
"""

from __future__ import annotations

from typing import Any

from refitflow.core.errors import ConfigError
from refitflow.layouts.canonical import LayoutMap, ModelDims, canonical_shapes, layer_shapes
from refitflow.layouts.rules import Only, Parallel, Table, Tables, build

__all__ = ["EXPERTS", "dims_from_config", "layout"]

_PLAIN = ("mlp.experts.gate", "mlp.experts.up", "mlp.experts.down")
_GATE, _UP, _DOWN = (("mlp.experts." + n,) for n in ("gate", "up", "down"))
EXPERTS: dict[str, Table] = {
    "fused": {
        "mlp.experts.gate_up_proj": ("experts_col", _GATE + _UP),
        "mlp.experts.down_proj": ("experts_row", _DOWN),
    },
    "mixtral": {
        "block_sparse_moe.experts.{j}.w1.weight": ("expert_col", _GATE),
        "block_sparse_moe.experts.{j}.w3.weight": ("expert_col", _UP),
        "block_sparse_moe.experts.{j}.w2.weight": ("expert_row", _DOWN),
    },
    "per_expert": {
        "mlp.experts.{j}.gate_proj.weight": ("expert_col", _GATE),
        "mlp.experts.{j}.up_proj.weight": ("expert_col", _UP),
        "mlp.experts.{j}.down_proj.weight": ("expert_row", _DOWN),
    },
}


def layout(d: ModelDims, *, experts: str = "fused", only: Only | None = None) -> LayoutMap:
    """The whole model under its HF names (``experts``: ``"fused"`` (transformers 5), ``"mixtral"`` or
    ``"per_expert"`` (checkpoint names)); ``only``: the per-expert entries built in part (``rules.Only``)."""
    if experts not in EXPERTS:
        raise ConfigError(f"unknown HF experts naming {experts!r}; known: {sorted(EXPERTS)}")
    top: Table = {n: ("rep", (n,)) for n in canonical_shapes(d) if not n.startswith("model.layers.")}
    names = {n for i in range(d.layers) for n in layer_shapes(d, i) if n not in _PLAIN}
    layer: Table = {n: ("rep", (n,)) for n in sorted(names)}
    tables = Tables(first=top, last={}, layer=layer, moe=EXPERTS[experts])
    return build(tables, "model.layers", d, Parallel(), only=only)


_MLA_TYPES = ("deepseek_v2", "deepseek_v3", "kimi_k2")


def _moe(c: Any) -> dict[str, Any]:
    """The MoE part of ModelDims from a transformers config (Mixtral, Qwen3-MoE, DeepSeek-V2/V3, Kimi-K2)."""
    experts = getattr(c, "num_local_experts", 0) or getattr(c, "num_experts", 0) or getattr(c, "n_routed_experts", 0)
    if not experts:
        return {"ffn": c.intermediate_size}
    if c.model_type == "mixtral":
        return {"experts": experts, "expert_ffn": c.intermediate_size}
    if getattr(c, "mlp_only_layers", None) or getattr(c, "decoder_sparse_step", 1) != 1:
        raise ConfigError("only leading dense layers are modelled (mlp_only_layers, decoder_sparse_step)")
    if getattr(c, "moe_layer_freq", 1) != 1 or getattr(c, "shared_expert_intermediate_size", 0):
        raise ConfigError("moe_layer_freq != 1 and gated shared experts (Qwen2-MoE) are not modelled")
    dense = getattr(c, "first_k_dense_replace", 0) or 0
    return {
        "experts": experts, "expert_ffn": c.moe_intermediate_size, "dense_layers": dense,
        "ffn": c.intermediate_size if dense else 0,
        "shared_ffn": c.moe_intermediate_size * (getattr(c, "n_shared_experts", 0) or 0),
        "router_bias": c.model_type in _MLA_TYPES and getattr(c, "topk_method", "noaux_tc") == "noaux_tc",
    }  # fmt: skip


def dims_from_config(c: Any) -> ModelDims:
    """ModelDims from a transformers config (Llama, Qwen2/3, Qwen3-MoE, Mixtral, DeepSeek-V2/V3, Kimi-K2)."""
    heads, mla = c.num_attention_heads, c.model_type in _MLA_TYPES
    attention: dict[str, Any] = (
        {
            "kv_heads": heads, "head_dim": c.qk_nope_head_dim, "q_lora_rank": c.q_lora_rank or 0,
            "kv_lora_rank": c.kv_lora_rank, "rope_dim": c.qk_rope_head_dim, "v_head_dim": c.v_head_dim,
        }
        if mla
        else {
            "kv_heads": getattr(c, "num_key_value_heads", None) or heads,
            "head_dim": getattr(c, "head_dim", None) or c.hidden_size // heads,
            "qkv_bias": c.model_type == "qwen2" or bool(getattr(c, "attention_bias", False)),
            "qk_norm": c.model_type in ("qwen3", "qwen3_moe"),
        }
    )  # fmt: skip
    return ModelDims(
        vocab=c.vocab_size, hidden=c.hidden_size, layers=c.num_hidden_layers, heads=heads,
        tied=bool(getattr(c, "tie_word_embeddings", False)), **attention, **_moe(c),
    )  # fmt: skip
