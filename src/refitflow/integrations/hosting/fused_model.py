"""A live inference model's parameters checked against the receiver layout the tables give for its rank.

An inference engine's worker (vLLM, SGLang) holds its TP/EP slice of the model under fused names
(``qkv_proj``, ``gate_up_proj``, ``experts.w13_weight``/``w2_weight``) with the vocabulary padded. The
integration asks the layout tables for this rank's layout (``layouts.fused.layout_for`` for vLLM,
``layouts.sglang.layout_for`` for SGLang, at the engine's place and vocabulary padding), and ``derive``
checks the model's real parameters against it:

- a parameter the layout has, of the layout's shape, is a target: refitflow writes it in place, whole
  parameter included — a padded vocabulary parameter is its own destination, its padding rows map to
  no canonical tensor, so they are never read, written or counted;
- a parameter the layout lacks, or of another shape, is *unmapped*; a layout entry the model lacks
  is *missing*. Either makes the model one to refit through its own ``load_weights`` instead.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from refitflow.layouts import fused
from refitflow.layouts.canonical import LayoutMap

__all__ = ["Derived", "derive", "parameters", "vocab_padding"]


@dataclass(frozen=True, kw_only=True)
class Derived:
    """What a receiver needs to write a live model in place."""

    targets: dict[str, torch.Tensor]  # local name -> the model's own parameter refitflow writes (whole, padding too)
    layout: LayoutMap  # the tables' layout of those parameters
    unmapped: dict[str, str]  # the model's parameters the layout cannot write -> why
    missing: list[str]  # parameters the layout expects and the model does not have

    @property
    def complete(self) -> bool:
        return not self.unmapped and not self.missing

    def why(self, limit: int = 8) -> str:
        """Why the model does not map, in words (empty when it does)."""
        parts = [f"{n}: {w}" for n, w in list(self.unmapped.items())[:limit]]
        if self.missing:
            parts.append(f"the model lacks {self.missing[:limit]}")
        return "; ".join(parts)


def derive(params: Iterable[tuple[str, torch.Tensor]], layout: LayoutMap) -> Derived:
    """Check ``params`` (a model's parameters, each once) against ``layout`` (this rank's, from the tables)."""
    targets: dict[str, torch.Tensor] = {}
    unmapped: dict[str, str] = {}
    for name, param in params:
        shape = tuple(param.shape)
        if name not in layout:
            unmapped[name] = "no entry in the layout tables"
        elif layout[name].shape != shape:
            unmapped[name] = f"shape {shape}, the layout says {layout[name].shape}"
        else:
            targets[name] = param  # the model's own tensor: a shadow swap (``param.data = ...``) must reach it
    missing = sorted(set(layout) - set(targets) - set(unmapped))
    return Derived(targets=targets, layout={n: layout[n] for n in targets}, unmapped=unmapped, missing=missing)


def parameters(model: torch.nn.Module | Mapping[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """A model's parameters, each tensor once (a tied LM head is the embedding)."""
    if isinstance(model, torch.nn.Module):
        return list(model.named_parameters())
    seen: set[int] = set()
    out = []
    for name, t in model.items():
        if id(t) not in seen:
            seen.add(id(t))
            out.append((name, t))
    return out


def vocab_padding(model: torch.nn.Module) -> int:
    """The vocabulary padding of the model's embedding (``VocabParallelEmbedding.padding_size``, which vLLM and
    SGLang share; 64 by default)."""
    for name, module in model.named_modules():
        if name.endswith("embed_tokens") and isinstance(getattr(module, "padding_size", None), int):
            return int(module.padding_size)
    return fused.VOCAB_PADDING
