"""Megatron-core GPT layout (publisher side): TP, EP, expert TP (Megatron-core's default: TP).

Names as Megatron-core 0.16 builds them. ``spec="te"`` (the default: ``get_gpt_layer_with_transformer_engine_spec``)
fuses norms into the following linear layer as ``layer_norm_weight`` where it can — the input norm
into ``linear_qkv``, the pre-MLP norm into a dense ``linear_fc1``, MLA's latent norms into
``linear_q_up_proj`` / ``linear_kv_up_proj`` — and keeps MLA's down projections replicated
(``TELinear``, ``parallel_mode="duplicated"``); ``spec="local"`` (``get_gpt_layer_local_spec``) keeps
every norm separate and splits the down projections over TP (``ColumnParallelLinear``). A MoE
layer keeps ``pre_mlp_layernorm`` in both. Experts are ``experts="sequential"`` (``SequentialMLP``,
Megatron's default: ``local_experts.{j}.linear_fc{1,2}.weight``) or ``"grouped"`` (``TEGroupedMLP``:
``linear_fc{1,2}.weight{j}``); ``j`` is the local expert index on this EP rank. The router is
``mlp.router.weight`` and, with ``moe_router_enable_expert_bias``, the buffer ``mlp.router.expert_bias``
(HF's ``e_score_correction_bias``); shared experts are TP-split like a dense MLP.

Megatron pads the vocabulary to a multiple of ``make-vocab-size-divisible-by`` × TP (default 128 × TP):
the embedding and output layer hold the padded rows, which map to nothing.

Pipeline parallel (``par.pp``): stage ``pp_rank`` holds its layers numbered from 0 (``decoder.layers.0``
is the stage's first layer), the embedding on the first stage, the final norm and output layer on the
last; layers are split evenly unless ``pp_layers`` (layers per stage) says otherwise
(``num_layers_in_first_pipeline_stage`` / ``..._last_...`` / a custom layout). Virtual pipeline
stages, and a tied output layer on a later stage than the embedding, are not modelled.
"""

from __future__ import annotations

from dataclasses import replace

from refitflow.core.errors import ConfigError
from refitflow.layouts.canonical import LayoutMap, ModelDims
from refitflow.layouts.rules import Only, Parallel, Table, Tables, build, pad

__all__ = ["EXPERTS", "FIRST", "LAST", "SPECS", "VOCAB_DIVISIBLE_BY", "layout", "padded_vocab"]

VOCAB_DIVISIBLE_BY = 128  # Megatron's --make-vocab-size-divisible-by default

_A, _M = "self_attention.", "mlp."
_QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
FIRST: Table = {"embedding.word_embeddings.weight": ("vocab", ("model.embed_tokens.weight",))}
LAST: Table = {
    "output_layer.weight": ("vocab", ("lm_head.weight",)),
    "decoder.final_layernorm.weight": ("rep", ("model.norm.weight",)),
}
_INPUT_NORM: Table = {"input_layernorm.weight": ("rep", ("input_layernorm.weight",))}
_PRE_MLP_NORM: Table = {"pre_mlp_layernorm.weight": ("rep", ("post_attention_layernorm.weight",))}
_ATTENTION: Table = {
    _A + "linear_qkv.weight": ("qkv_grouped", tuple(n + ".weight" for n in _QKV)),
    _A + "linear_qkv.bias": ("qkv_grouped", tuple(n + ".bias" for n in _QKV)),
    _A + "q_layernorm.weight": ("rep", ("self_attn.q_norm.weight",)),
    _A + "k_layernorm.weight": ("rep", ("self_attn.k_norm.weight",)),
    _A + "linear_proj.weight": ("row", ("self_attn.o_proj.weight",)),
}
_MLA: Table = {
    _A + "linear_q_proj.weight": ("col", ("self_attn.q_proj.weight",)),  # no q_lora_rank
    _A + "linear_q_up_proj.weight": ("col", ("self_attn.q_b_proj.weight",)),
    _A + "linear_kv_up_proj.weight": ("col", ("self_attn.kv_b_proj.weight",)),
    _A + "linear_proj.weight": ("row", ("self_attn.o_proj.weight",)),
}
_MLA_LOCAL: Table = {
    _A + "linear_q_down_proj.weight": ("col", ("self_attn.q_a_proj.weight",)),
    _A + "q_layernorm.weight": ("rep", ("self_attn.q_a_layernorm.weight",)),
    _A + "linear_kv_down_proj.weight": ("col", ("self_attn.kv_a_proj_with_mqa.weight",)),
    _A + "kv_layernorm.weight": ("rep", ("self_attn.kv_a_layernorm.weight",)),
}
_MLA_TE: Table = {
    _A + "linear_q_down_proj.weight": ("rep", ("self_attn.q_a_proj.weight",)),
    _A + "linear_q_up_proj.layer_norm_weight": ("rep", ("self_attn.q_a_layernorm.weight",)),
    _A + "linear_kv_down_proj.weight": ("rep", ("self_attn.kv_a_proj_with_mqa.weight",)),
    _A + "linear_kv_up_proj.layer_norm_weight": ("rep", ("self_attn.kv_a_layernorm.weight",)),
}
_DENSE: Table = {
    _M + "linear_fc1.weight": ("col", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
    _M + "linear_fc2.weight": ("row", ("mlp.down_proj.weight",)),
}
_MOE: Table = _PRE_MLP_NORM | {
    _M + "router.weight": ("rep", ("mlp.gate.weight",)),
    _M + "router.expert_bias": ("rep", ("mlp.gate.e_score_correction_bias",)),
    _M + "shared_experts.linear_fc1.weight": (
        "col", ("mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight")
    ),
    _M + "shared_experts.linear_fc2.weight": ("row", ("mlp.shared_experts.down_proj.weight",)),
}  # fmt: skip
_FC1, _FC2 = ("mlp.experts.gate", "mlp.experts.up"), ("mlp.experts.down",)
EXPERTS: dict[str, Table] = {
    "sequential": {
        _M + "experts.local_experts.{j}.linear_fc1.weight": ("expert_col", _FC1),
        _M + "experts.local_experts.{j}.linear_fc2.weight": ("expert_row", _FC2),
    },
    "grouped": {
        _M + "experts.linear_fc1.weight{j}": ("expert_col", _FC1),
        _M + "experts.linear_fc2.weight{j}": ("expert_row", _FC2),
    },
}
SPECS: dict[str, Tables] = {
    "te": Tables(
        first=FIRST,
        last=LAST,
        attention={_A + "linear_qkv.layer_norm_weight": ("rep", ("input_layernorm.weight",))} | _ATTENTION,
        mla=_INPUT_NORM | _MLA | _MLA_TE,
        dense={_M + "linear_fc1.layer_norm_weight": ("rep", ("post_attention_layernorm.weight",))} | _DENSE,
        moe=_MOE,
    ),
    "local": Tables(
        first=FIRST,
        last=LAST,
        attention=_INPUT_NORM | _ATTENTION,
        mla=_INPUT_NORM | _MLA | _MLA_LOCAL,
        dense=_PRE_MLP_NORM | _DENSE,
        moe=_MOE,
    ),
}


def padded_vocab(vocab: int, tp: int, vocab_divisible_by: int = VOCAB_DIVISIBLE_BY) -> int:
    """The rows of Megatron's padded embedding: ``vocab`` rounded up to ``vocab_divisible_by`` × ``tp``."""
    return pad(vocab, vocab_divisible_by * tp)


def layout(
    d: ModelDims,
    par: Parallel,
    *,
    spec: str = "te",
    experts: str = "sequential",
    vocab_divisible_by: int = VOCAB_DIVISIBLE_BY,
    pp_layers: tuple[int, ...] | list[int] | None = None,
    only: Only | None = None,
) -> LayoutMap:
    """This rank's Megatron-core parameters (``spec``: ``"te"`` or ``"local"``; ``experts``: ``"sequential"``
    or ``"grouped"``); expert TP is ``par.expert_tp``, TP when unset (Megatron-core's default). ``only``:
    the per-expert entries built in part (``rules.Only``: planning's, never a manifest's option)."""
    if d.tied and par.pp > 1:
        raise ConfigError("a tied output layer under pipeline parallelism is not modelled")
    if spec not in SPECS or experts not in EXPERTS:
        raise ConfigError(f"unknown Megatron spec {spec!r} or experts {experts!r}: {sorted(SPECS)}, {sorted(EXPERTS)}")
    tables = SPECS[spec]
    tables = replace(tables, moe=tables.moe | EXPERTS[experts])
    rows = padded_vocab(d.vocab, par.tp, vocab_divisible_by)
    stages = None if pp_layers is None else tuple(pp_layers)
    return build(tables, "decoder.layers", d, par, vocab_rows=rows, stages=stages, local_index=True, only=only)
