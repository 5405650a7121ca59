"""The receiver layout of a live fused-inference model (vLLM, SGLang), derived from its own parameters.

An inference engine's worker holds its TP/EP slice of the model under fused names (``qkv_proj``,
``gate_up_proj``, ``experts.w13_weight``/``w2_weight``) and pads the vocabulary rows of the embedding
and the LM head. ``derive`` walks the model's parameters, finds each one's rule in the fused table
(``layouts.fused``) for this rank's place, and checks the parameter's actual shape against it:

- a parameter whose shape matches is written whole, in place;
- a vocabulary parameter (embedding, LM head) with more rows than its slice of the vocabulary carries
  padding: rank ``r`` of ``tp`` holds rows ``[r·n, (r+1)·n)`` of the padded vocabulary (``n`` = its
  local rows), of which those below ``vocab`` are real. Only the real rows are written; the padding
  is neither read nor counted as missing (today: the real rows are handed to the receiver as a view
  of the live parameter — same storage, pointers unchanged);
- anything else (no rule, another shape, a name the table does not know) is *unmapped*: such a
  model is refitted through its own ``load_weights`` instead.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from refitflow.layouts import fused
from refitflow.layouts.canonical import LayoutMap, LocalTensor, ModelDims, Segment
from refitflow.layouts.rules import Parallel, Table, build

__all__ = ["ALIASES", "VOCAB", "Derived", "derive", "local_shapes", "parameters", "vocab_rows"]

# the vocabulary-parallel parameters: local name -> canonical tensor (their rows are padded)
VOCAB = {"model.embed_tokens.weight": "model.embed_tokens.weight", "lm_head.weight": "lm_head.weight"}
# engine module names that mean the same as the fused table's (vLLM's Mixtral: ``block_sparse_moe``)
ALIASES = {".block_sparse_moe.": ".mlp."}


@dataclass(frozen=True, kw_only=True)
class Derived:
    """What a receiver needs to write a live model in place."""

    targets: dict[str, torch.Tensor]  # local name -> the live tensor refitflow writes (a view for padded rows)
    layout: LayoutMap  # local name -> shape and canonical segments of its target
    padded: dict[str, int]  # local name -> padding rows left untouched
    unmapped: list[str]  # parameters no rule maps (the model must be refitted through load_weights)

    @property
    def complete(self) -> bool:
        return not self.unmapped


def vocab_rows(vocab: int, local_rows: int, tp_rank: int) -> tuple[int, int]:
    """The canonical rows ``[start, stop)`` of vocabulary-parallel rank ``tp_rank`` holding ``local_rows``.

    The engine pads the vocabulary so that every rank holds the same number of rows, in order; rows at
    or past ``vocab`` are padding.
    """
    start = min(tp_rank * local_rows, vocab)
    return start, min(start + local_rows, vocab)


def _table_name(name: str) -> str:
    for alias, canonical in ALIASES.items():
        name = name.replace(alias, canonical)
    return name


def _rules(dims: ModelDims, par: Parallel) -> LayoutMap:
    """The fused table's layout for this rank, less the vocabulary parameters (their rows are padded)."""
    top: Table = {k: v for k, v in fused.TOP.items() if k not in VOCAB}
    return build(top, fused.LAYER, "model.layers", dims, par)


def local_shapes(dims: ModelDims, par: Parallel, vocab_rows_per_rank: int) -> dict[str, tuple[int, ...]]:
    """The parameter shapes of a fused model at ``par`` whose vocabulary is padded to ``tp · vocab_rows_per_rank``."""
    shapes = {n: lt.shape for n, lt in _rules(dims, par).items()}
    return shapes | {n: (vocab_rows_per_rank, dims.hidden) for n, c in VOCAB.items() if c in _vocab_tensors(dims)}


def derive(params: Iterable[tuple[str, torch.Tensor]], dims: ModelDims, par: Parallel) -> Derived:
    """Map ``params`` (a model's ``named_parameters()``, tied ones once) onto canonical tensors."""
    rules = _rules(dims, par)
    targets: dict[str, torch.Tensor] = {}
    layout: LayoutMap = {}
    padded: dict[str, int] = {}
    unmapped: list[str] = []
    for name, param in params:
        key = _table_name(name)
        shape = tuple(param.shape)
        if key in VOCAB and VOCAB[key] in _vocab_tensors(dims) and param.dim() == 2 and shape[1] == dims.hidden:
            start, stop = vocab_rows(dims.vocab, shape[0], par.tp_rank)
            if stop > start:  # a rank holding only padding has nothing to write
                targets[name] = param.detach()[: stop - start]
                box = ((start, stop), (0, dims.hidden))
                lbox = ((0, stop - start), (0, dims.hidden))
                layout[name] = LocalTensor((stop - start, dims.hidden), (Segment(VOCAB[key], box, lbox),))
            padded[name] = shape[0] - (stop - start)
        elif key in rules and rules[key].shape == shape:
            targets[name] = param.detach()
            layout[name] = rules[key]
        else:
            unmapped.append(name)
    return Derived(targets=targets, layout=layout, padded=padded, unmapped=unmapped)


def _vocab_tensors(dims: ModelDims) -> set[str]:
    return {"model.embed_tokens.weight"} | (set() if dims.tied else {"lm_head.weight"})


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
