"""The arithmetic of the formats in ``layouts/quant.py``: quantise float32 values, dequantise, and re-store
scales, with torch ops on the tensors' own device.

Conventions (each format's published definition; an all-zero block's scale is the one noted):
- ``fp8_block128``, ``fp8_channel``: ``s = amax / 448`` (1 for an all-zero block), ``q = e4m3(x / s)``.
- ``fp8_block128_pow2``: ``s = 2^ceil(log2(amax / 448))`` (1 for an all-zero block), ``q = e4m3(x / s)``.
- ``mxfp8`` (OCP MX v1.0): ``s = 2^(floor(log2(amax)) - 8)``, stored as its biased exponent (E8M0, bias 127;
  code 0 for an all-zero block), ``q = e4m3(x / s)`` saturated to ±448.
- ``nvfp4``: ``g = amax(tensor) / (448 · 6)`` (1 for an all-zero tensor), ``s = e4m3(amax(block) / 6 / g)``,
  ``q = e2m1(x / (s · g))`` (0 where ``s · g`` is 0) saturated to ±6; two codes a byte, the even element in
  the low nibble. Dequantised: ``q · (s · g)``.
Rounding is to nearest, ties to even; ``e4m3`` saturates to ±448 before rounding.
"""

from __future__ import annotations

import torch

from refitflow.layouts.quant import QuantFormat

__all__ = ["decode_scales", "dequantize", "encode_scales", "quantize"]

E4M3_MAX = 448.0
E2M1_MAX = 6.0
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)  # midpoints between neighbouring codes
_TIES_UP = (0.75, 1.75, 3.5)  # midpoints whose upper neighbour has the even code


def _blocks(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``x`` (..., N, K) zero-padded to whole blocks, viewed (..., N/br, br, K/bc, bc)."""
    rows, cols = x.shape[-2], x.shape[-1]
    br, bc = block[0] or rows, block[1] or cols
    padded = torch.nn.functional.pad(x, (0, -cols % bc, 0, -rows % br))
    r, c = padded.shape[-2], padded.shape[-1]
    return padded.view(*x.shape[:-2], r // br, br, c // bc, bc)


def _spread(s: torch.Tensor, block: tuple[int, int], rows: int, cols: int) -> torch.Tensor:
    """One scale per block → one per element (..., rows, cols)."""
    br, bc = block[0] or rows, block[1] or cols
    return s.repeat_interleave(br, dim=-2).repeat_interleave(bc, dim=-1)[..., :rows, :cols]


def _e4m3(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def _pow2_ceil(v: torch.Tensor) -> torch.Tensor:
    """``2^ceil(log2 v)`` exactly (v > 0): ``v = m·2^e``, ``m`` in [0.5, 1)."""
    m, e = torch.frexp(v)
    return torch.ldexp(torch.ones_like(v), torch.where(m == 0.5, e - 1, e))


def _e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """e2m1 codes (sign in bit 3) of ``v``, rounded to nearest, ties to even, saturated to ±6."""
    a = v.abs().clamp(max=E2M1_MAX)
    bounds = torch.tensor(_E2M1_BOUNDS, dtype=v.dtype, device=v.device)
    code = torch.bucketize(a, bounds)  # a tie goes to the lower code ...
    ties = torch.tensor(_TIES_UP, dtype=v.dtype, device=v.device)
    code = code + torch.isin(a, ties).to(code.dtype)  # ... but where the upper one is even
    return (code | torch.where(v < 0, 8, 0)).to(torch.uint8)


def quantize(fmt: QuantFormat, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``x`` (float32, (..., N, K) elements) as ``fmt``: values, canonical scales, global scale (or None)."""
    x = x.float()
    if fmt.same == "nvfp4":
        return _nvfp4(x)
    b = _blocks(x, fmt.block)
    amax = b.abs().amax(dim=(-3, -1))
    if fmt.same == "mxfp8":
        _, e = torch.frexp(amax)
        exp = (e - 1 - 8).clamp(-127, 127)  # floor(log2 amax) - emax(e4m3)
        code = torch.where(amax > 0, exp + 127, 0).to(torch.uint8)
        s = torch.ldexp(torch.ones_like(amax), code.to(torch.int32) - 127)
        scales: torch.Tensor = code
    else:
        s = torch.where(amax > 0, amax / E4M3_MAX, 1.0)
        if fmt.same == "fp8_block128_pow2":
            s = _pow2_ceil(s)
        scales = s
    q = _e4m3(b / s[..., :, None, :, None])  # per block, on the padded block view: no per-element scale tensor
    q = q.reshape(*x.shape[:-2], b.shape[-4] * b.shape[-3], b.shape[-2] * b.shape[-1])
    return q[..., : x.shape[-2], : x.shape[-1]].contiguous(), scales, None


def _nvfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if x.shape[-1] % 2:
        raise ValueError("nvfp4 needs an even number of columns")
    flat = x.abs().flatten(-2)
    g = flat.amax(dim=-1) / (E4M3_MAX * E2M1_MAX) if flat.shape[-1] else torch.zeros(x.shape[:-2])
    g = torch.where(g > 0, g, 1.0)
    amax = _blocks(x, (1, 16)).abs().amax(dim=(-3, -1))
    s = _e4m3(amax / E2M1_MAX / g[..., None, None])
    eff = _spread(s.float() * g[..., None, None], (1, 16), x.shape[-2], x.shape[-1])
    v = torch.where(eff > 0, x / eff, 0.0)
    codes = _e2m1_codes(v)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), s, g


def dequantize(fmt: QuantFormat, q: torch.Tensor, scales: torch.Tensor, g: torch.Tensor | None) -> torch.Tensor:
    """float32 elements of values ``q`` with canonical ``scales`` (and global ``g``)."""
    if fmt.same == "nvfp4":
        assert g is not None
        table = torch.tensor(_E2M1, dtype=torch.float32, device=q.device)
        lo, hi = (q & 7).long(), ((q >> 4) & 7).long()
        vals = torch.stack((table[lo] * torch.where(q & 8 > 0, -1.0, 1.0),
                            table[hi] * torch.where(q & 128 > 0, -1.0, 1.0)), dim=-1).flatten(-2)  # fmt: skip
        s = scales.float() * g.reshape(*g.shape[: q.dim() - 2], 1, 1).float()
        return vals * _spread(s, (1, 16), vals.shape[-2], vals.shape[-1])
    if fmt.same == "mxfp8":
        s = torch.ldexp(torch.ones(scales.shape, device=scales.device), scales.to(torch.int32) - 127)
    else:
        s = scales.float()
    return q.float() * _spread(s, fmt.block, q.shape[-2], q.shape[-1])


def encode_scales(fmt: QuantFormat, scales: torch.Tensor, rows: int) -> torch.Tensor:
    """Canonical scales as ``fmt`` stores them (``rows``: the values' rows)."""
    if fmt.storage != "ue8m0_packed":
        return scales
    per_row = scales.repeat_interleave(fmt.block[0], dim=-2)[..., :rows, :]
    exps = ((per_row.view(torch.int32) >> 23) & 0xFF).to(torch.uint8)
    lead, kb = exps.shape[:-2], exps.shape[-1]
    padded = torch.zeros((*lead, -(-rows // 4) * 4, -(-kb // 4) * 4), dtype=torch.uint8, device=exps.device)
    padded[..., :rows, :kb] = exps
    words = padded.view(torch.int32)  # (..., align4(N), K/4): four exponents a word, little end first
    return words.transpose(-1, -2).contiguous()  # MN-major


def decode_scales(fmt: QuantFormat, stored: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``fmt``'s stored scales as canonical ones (``shape``: the values' shape)."""
    if fmt.storage != "ue8m0_packed":
        return stored
    want = fmt.scale_shape(shape)
    exps = stored.transpose(-1, -2).contiguous().view(torch.uint8)[..., : shape[-2] : fmt.block[0], : want[-1]]
    return torch.ldexp(torch.ones(exps.shape, device=exps.device), exps.to(torch.int32) - 127)
