"""vLLM's latent-attention weights that are derived after loading, not loaded (DeepSeek-V2/V3, Kimi-K2).

vLLM's ``MLAAttention.process_weights_after_loading`` splits ``kv_b_proj`` into ``W_UK_T`` and ``W_UV``
(and, on some backends, quantised or gathered forms of them), registered as parameters of the
attention layer. They are in no checkpoint and no layout table: a refit writes ``kv_b_proj`` and must
derive them again, or the model decodes with the previous version's attention. So:

- ``derived_parameters``: the attention layers' own parameters — left out of the receiver layout and of
  the ``load_weights`` coverage;
- ``rederive``: after a version is committed, each layer runs vLLM's own ``process_weights_after_loading``
  again (what vLLM's loader runs after loading); vLLM's ``replace_parameter`` copies the new values into
  the existing tensors, so their pointers (and captured CUDA graphs) stay valid.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["derived_parameters", "latent_attention_layers", "rederive"]


def latent_attention_layers(model: torch.nn.Module) -> list[tuple[str, Any]]:
    """The model's ``MLAAttention`` layers, by module name."""
    from vllm.model_executor.layers.attention import MLAAttention

    return [(n, m) for n, m in model.named_modules() if isinstance(m, MLAAttention)]


def derived_parameters(model: torch.nn.Module) -> set[str]:
    """The parameters the latent-attention layers derive from ``kv_b_proj`` (their own, not their children's)."""
    return {f"{name}.{p}" for name, m in latent_attention_layers(model) for p, _ in m.named_parameters(recurse=False)}


def rederive(model: torch.nn.Module, dtype: torch.dtype) -> list[str]:
    """Derive every latent-attention layer's weights from its ``kv_b_proj`` again (``dtype``: the model's
    activation dtype, vLLM's ``model_config.dtype``); the derived parameters whose storage moved (a captured
    CUDA graph would still read the old one), normally none."""
    moved = []
    with torch.no_grad():
        for name, layer in latent_attention_layers(model):
            before = {p: t.data_ptr() for p, t in layer.named_parameters(recurse=False)}
            layer.process_weights_after_loading(dtype)
            after = {p: t.data_ptr() for p, t in layer.named_parameters(recurse=False)}
            moved += [f"{name}.{p}" for p, ptr in after.items() if before.get(p, ptr) != ptr]
    return moved
