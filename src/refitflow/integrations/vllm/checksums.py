"""Checksums in the form of vLLM's ``/weight_checker`` route, to cross-check a commit from outside.

vLLM's route answers ``{"checksums": {"dp{d}:pp{p}:pcp{c}:tp{t}:<parameter>": sha256 hex}}``: the
SHA-256 of each parameter's bytes as the worker holds them (its TP slice, fused, padded). The
trainer computes the same map from the canonical tensors it published (``expected_checksums``) and
posts it as ``{"action": "compare", "baseline": ...}``: ``{"match": true}`` means every worker holds
exactly the published bytes. vLLM zero-fills the vocabulary padding rows at load, and refitflow never
writes them, so the expected padding is zeros. Covers plain (unquantised) parameters, ``pp == 1``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch

from refitflow.integrations.fused_model import derive, local_shapes
from refitflow.integrations.vllm.place import Place
from refitflow.layouts.canonical import ModelDims, from_canonical

__all__ = ["digest", "expected_checksums", "model_checksums", "prefix"]


def digest(tensor: torch.Tensor) -> str:
    """SHA-256 of a tensor's bytes (what vLLM's checker computes for a plain parameter)."""
    data = tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()
    return hashlib.sha256(data.data).hexdigest()


def prefix(*, dp: int = 0, pp: int = 0, pcp: int = 0, tp: int = 0) -> str:
    return f"dp{dp}:pp{pp}:pcp{pcp}:tp{tp}:"


def model_checksums(model: torch.nn.Module, key_prefix: str = "") -> dict[str, str]:
    """One worker's part of vLLM's ``/weight_checker`` answer, for a model of plain parameters."""
    return {key_prefix + name: digest(p) for name, p in model.named_parameters()}


def expected_checksums(
    canonical: Mapping[str, torch.Tensor], dims: ModelDims, *, tp: int = 1, dp: int = 1,
    expert_parallel: bool = False, pad_to: int = 64,
) -> dict[str, str]:  # fmt: skip
    """The ``/weight_checker`` checksums of a vLLM server holding ``canonical`` (the published version)."""
    dtype = next(iter(canonical.values())).dtype
    vocab_rows_per_rank = -(-dims.vocab // pad_to) * pad_to // tp
    out: dict[str, str] = {}
    for d in range(dp):
        for r in range(tp):
            place = Place(rank=r, world=tp, tp=tp, dp=dp, dp_index=d, expert_parallel=expert_parallel)
            par = place.parallel(dims)
            shapes = local_shapes(dims, par, vocab_rows_per_rank)
            params = [(n, torch.zeros(s, dtype=dtype)) for n, s in shapes.items()]
            derived = derive(params, dims, par)
            local = from_canonical(derived.layout, canonical)
            for name, tensor in params:
                if name in local:
                    tensor[: local[name].shape[0]] = local[name]
                out[prefix(dp=d, tp=r) + name] = digest(tensor)
    return out
