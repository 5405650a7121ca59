"""A synthetic transformer-shaped model for the demo and benchmarks (no download, any size)."""

from __future__ import annotations

import torch

__all__ = ["synthetic_model"]


def synthetic_model(
    total_bytes: int, *, dtype: torch.dtype = torch.bfloat16, hidden: int = 1024, seed: int = 0
) -> dict[str, torch.Tensor]:
    """Llama-like named weights (attention, MLP, norms, embeddings) adding up to about ``total_bytes``."""
    gen = torch.Generator().manual_seed(seed)
    item = torch.empty((), dtype=dtype).element_size()
    vocab, ffn = 4 * hidden, (8 * hidden) // 3
    per_layer = (4 * hidden * hidden + 3 * hidden * ffn + 2 * hidden) * item
    fixed = (2 * vocab * hidden + hidden) * item
    layers = max(1, (total_bytes - fixed) // per_layer)
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (hidden, hidden),
            p + "self_attn.k_proj.weight": (hidden, hidden),
            p + "self_attn.v_proj.weight": (hidden, hidden),
            p + "self_attn.o_proj.weight": (hidden, hidden),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "mlp.gate_proj.weight": (ffn, hidden),
            p + "mlp.up_proj.weight": (ffn, hidden),
            p + "mlp.down_proj.weight": (hidden, ffn),
        }
    shapes |= {"model.norm.weight": (hidden,), "lm_head.weight": (vocab, hidden)}
    return {n: (torch.rand(s, generator=gen) - 0.5).to(dtype) for n, s in shapes.items()}
