"""FP8 (``float8_e4m3fn``) per-block quantisation: 128×128 blocks, one fp32 scale per block.

``scale_inv[i, j] = amax(block) / 448`` (1 for an all-zero block); ``q = (x / scale_inv).to(fp8)``,
so ``x ≈ q.float() * scale_inv`` expanded over the block (the ``weight_scale_inv`` convention).
"""

from __future__ import annotations

import torch

__all__ = ["BLOCK", "FP8_MAX", "dequantize", "quantize_into", "scale_name", "scale_shape"]

BLOCK = 128
FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)


def scale_name(param: str) -> str:
    return param + "_scale_inv"


def scale_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    rows, cols = shape[-2], shape[-1]
    return (*shape[:-2], -(-rows // BLOCK), -(-cols // BLOCK))


def _blocks(x: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """``x`` zero-padded to whole blocks, viewed (..., R/B, B, C/B, B)."""
    rows, cols = x.shape[-2], x.shape[-1]
    pr, pc = -rows % BLOCK, -cols % BLOCK
    padded = torch.nn.functional.pad(x, (0, pc, 0, pr))
    lead = padded.shape[:-2]
    return padded.view(*lead, (rows + pr) // BLOCK, BLOCK, (cols + pc) // BLOCK, BLOCK), rows, cols


def quantize_into(x: torch.Tensor, q: torch.Tensor, scale_inv: torch.Tensor) -> None:
    """Quantise ``x`` (≥ 2-D, float) into ``q`` (fp8, same shape) and ``scale_inv`` (fp32)."""
    b, rows, cols = _blocks(x.float())
    amax = b.abs().amax(dim=(-3, -1))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    quant = (b / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    full = quant.view(*b.shape[:-4], b.shape[-4] * BLOCK, b.shape[-2] * BLOCK)
    q.copy_(full[..., :rows, :cols])
    scale_inv.copy_(scale)


def dequantize(q: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    rows, cols = q.shape[-2], q.shape[-1]
    s = scale_inv.repeat_interleave(BLOCK, dim=-2).repeat_interleave(BLOCK, dim=-1)[..., :rows, :cols]
    return q.float() * s
