"""A synthetic transformer-shaped model for the demo and benchmarks (no download, any size)."""

from __future__ import annotations

import math

import torch

__all__ = ["synthetic_model", "synthetic_nbytes", "synthetic_shapes"]


def synthetic_shapes(total_bytes: int, *, itemsize: int = 2, hidden: int = 1024) -> dict[str, tuple[int, ...]]:
    """Llama-like weight names and shapes (attention, MLP, norms, embeddings) adding up to about ``total_bytes``."""
    item = itemsize
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
    return shapes


def synthetic_nbytes(total_bytes: int, *, itemsize: int = 2) -> int:
    """The exact bytes of ``synthetic_shapes(total_bytes)`` at ``itemsize`` bytes per element."""
    return sum(math.prod(s) * itemsize for s in synthetic_shapes(total_bytes, itemsize=itemsize).values())


def synthetic_model(
    total_bytes: int, *, dtype: torch.dtype = torch.bfloat16, hidden: int = 1024, seed: int = 0, device: str = "cpu"
) -> dict[str, torch.Tensor]:
    """A synthetic model of ``synthetic_shapes`` with pseudo-random values (deterministic per seed), on ``device``."""
    gen = torch.Generator().manual_seed(seed)
    shapes = synthetic_shapes(total_bytes, itemsize=torch.empty((), dtype=dtype).element_size(), hidden=hidden)
    base = (torch.rand(1 << 20, generator=gen) - 0.5).to(dtype).to(device)  # tiled: fast to build at GB sizes
    out = {}
    for k, (name, shape) in enumerate(shapes.items()):
        numel = math.prod(shape)
        reps = -(-numel // base.numel())
        out[name] = (base.roll(k * 7919).repeat(reps)[:numel] + k * 1e-3).view(shape).contiguous()
    return out
