"""SGLang 0.5 inference layout (receiver side): vLLM's fused names, two differences.

- Latent attention fuses the A projections as ``self_attn.fused_qkv_a_proj_with_mqa``
  (``[q_a_proj; kv_a_proj_with_mqa]``, replicated) where vLLM says ``fused_qkv_a_proj``.
- The vocabulary is padded to a multiple of 64, or of 64 × TP when TP does not split that evenly
  (``VocabParallelEmbedding``: ``padding_size *= tp_size``).

Attention-DP (``--enable-dp-attention``, attention TP smaller than TP) is not modelled.
"""

from __future__ import annotations

from typing import Any

from refitflow.layouts import fused
from refitflow.layouts.canonical import LayoutMap, ModelDims
from refitflow.layouts.rules import Parallel, Table, pad

__all__ = ["MLA_Q_LORA", "VOCAB_PADDING", "layout", "layout_for", "padded_vocab"]

VOCAB_PADDING = 64  # SGLang's DEFAULT_VOCAB_PADDING_SIZE
_FUSED, _SGLANG = "self_attn.fused_qkv_a_proj.weight", "self_attn.fused_qkv_a_proj_with_mqa.weight"
MLA_Q_LORA: Table = {(_SGLANG if k == _FUSED else k): v for k, v in fused.MLA_Q_LORA.items()}


def padded_vocab(vocab: int, tp: int, vocab_padding: int = VOCAB_PADDING) -> int:
    """SGLang's padded vocabulary: a multiple of ``vocab_padding``, or of ``vocab_padding × tp`` if TP needs it."""
    rows = pad(vocab, vocab_padding)
    return rows if rows % tp == 0 else pad(vocab, vocab_padding * tp)


def layout(
    d: ModelDims,
    par: Parallel,
    *,
    vocab_padding: int = VOCAB_PADDING,
    moe_module: str = "mlp",
    pp_layers: tuple[int, ...] | list[int] | None = None,
) -> LayoutMap:
    """This rank's SGLang parameters (``moe_module``: ``block_sparse_moe`` for Mixtral; pipeline stages
    split as vLLM splits them unless ``pp_layers`` says otherwise)."""
    tables = fused.tables(d, moe_module=moe_module, mla_q_lora=MLA_Q_LORA, routed="")
    return fused.build_fused(tables, d, par, padded_vocab(d.vocab, par.tp, vocab_padding), pp_layers)


def layout_for(config: Any, par: Parallel, *, vocab_padding: int = VOCAB_PADDING) -> LayoutMap:
    """The SGLang layout of a model from its HF config and this rank's place."""
    return fused.layout_for(config, par, vocab_padding=vocab_padding, make=layout)
