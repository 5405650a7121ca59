"""An independent reference for the quantised formats, in numpy, written from their published definitions
(not from refitflow's functions): every representable e4m3 / e2m1 value is tabulated from the bit layout
and values are rounded to the nearest one, ties to the even code.

- FP8 e4m3 (OCP 8-bit FP, "E4M3FN"): bias 7, no infinities, S.1111.111 is NaN, max 448, subnormals m/8·2^-6.
- e2m1 (OCP MX FP4): {0, 0.5, 1, 1.5, 2, 3, 4, 6}, sign in bit 3.
- DeepSeek-V3 block FP8 (``weight_scale_inv``): one fp32 scale per 128×128 block, ``s = amax/448``.
- DeepGEMM UE8M0 (SGLang on Blackwell): the block scale rounded up to a power of two; stored as each row's
  biased exponents, four bytes to an int32 word, words MN-major, rows padded to a multiple of 4.
- compressed-tensors channel FP8: one fp32 scale per output row, ``s = amax/448``.
- OCP MX v1.0 MXFP8: 32-element blocks, ``X = 2^(floor(log2 amax) - 8)`` stored E8M0 (bias 127).
- NVIDIA NVFP4: ``g = amax/(448·6)``, per 16 elements ``s = e4m3(amax_b/6/g)``, ``q = e2m1(x/(s·g))``,
  the even element in the low nibble.
An all-zero block's scale is 1 (E8M0: code 0), as refitflow documents.
"""

from __future__ import annotations

import numpy as np

F32 = np.float32


def _e4m3_table() -> np.ndarray:
    vals = []
    for code in range(0x7F):  # 0x7F is NaN
        e, m = code >> 3, code & 7
        vals.append((m / 8) * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return np.array(vals, dtype=np.float64)


E4M3 = _e4m3_table()  # by code, increasing
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _round_codes(a: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Codes of the nearest table values to ``a`` (≥ 0, ≤ the table's max), ties to the even code."""
    hi = np.searchsorted(table, a, side="left").clip(0, len(table) - 1)
    lo = (hi - 1).clip(0)
    dlo, dhi = a - table[lo], table[hi] - a
    pick_hi = (dhi < dlo) | ((dhi == dlo) & (hi % 2 == 0))
    return np.where(a == table[hi], hi, np.where(pick_hi, hi, lo))


def e4m3_codes(v: np.ndarray) -> np.ndarray:
    a = np.minimum(np.abs(v.astype(np.float64)), 448.0)
    codes = _round_codes(a, E4M3)
    return (codes | np.where(np.signbit(v), 0x80, 0)).astype(np.uint8)


def e4m3_value(codes: np.ndarray) -> np.ndarray:
    return (E4M3[codes & 0x7F] * np.where(codes & 0x80, -1, 1)).astype(F32)


def e2m1_codes(v: np.ndarray) -> np.ndarray:
    a = np.minimum(np.abs(v.astype(np.float64)), 6.0)
    return (_round_codes(a, E2M1) | np.where(np.signbit(v), 8, 0)).astype(np.uint8)


def _blocks(x: np.ndarray, br: int, bc: int):
    n, k = x.shape
    br, bc = br or n, bc or k
    out = np.zeros((-(-n // br) * br, -(-k // bc) * bc), dtype=F32)
    out[:n, :k] = x
    return out.reshape(out.shape[0] // br, br, out.shape[1] // bc, bc), br, bc


def _amax(x: np.ndarray, br: int, bc: int) -> tuple[np.ndarray, int, int]:
    b, br, bc = _blocks(x, br, bc)
    return np.abs(b).max(axis=(1, 3)), br, bc


def _spread(s: np.ndarray, br: int, bc: int, n: int, k: int) -> np.ndarray:
    return np.repeat(np.repeat(s, br, axis=0), bc, axis=1)[:n, :k]


def fp8_scaled(x: np.ndarray, block: tuple[int, int], pow2: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(e4m3 codes, fp32 scales) with ``s = amax/448`` per block (``pow2``: rounded up to a power of two)."""
    x = x.astype(F32)
    amax, br, bc = _amax(x, *block)
    s = np.where(amax > 0, amax / F32(448), F32(1)).astype(F32)
    if pow2:
        m, e = np.frexp(s)
        s = np.ldexp(F32(1), np.where(m == 0.5, e - 1, e)).astype(F32)
    q = e4m3_codes(x / _spread(s, br, bc, *x.shape))
    return q, s


def mxfp8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    x = x.astype(F32)
    amax, br, bc = _amax(x, 1, 32)
    _, e = np.frexp(amax)
    code = np.where(amax > 0, np.clip(e - 1 - 8, -127, 127) + 127, 0).astype(np.uint8)
    scale = np.ldexp(F32(1), code.astype(np.int32) - 127).astype(F32)
    return e4m3_codes(x / _spread(scale, br, bc, *x.shape)), code


def nvfp4(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.float32]:
    x = x.astype(F32)
    g = F32(np.abs(x).max() / F32(448 * 6))
    g = g if g > 0 else F32(1)
    amax, br, bc = _amax(x, 1, 16)
    s = e4m3_codes((amax / F32(6)) / g)
    eff = _spread(e4m3_value(s) * g, br, bc, *x.shape).astype(F32)
    v = np.where(eff > 0, x / np.where(eff > 0, eff, F32(1)), F32(0))
    c = e2m1_codes(v)
    return (c[:, 0::2] | (c[:, 1::2] << 4)).astype(np.uint8), s, g


def nvfp4_dequant(q: np.ndarray, s: np.ndarray, g: np.float32) -> np.ndarray:
    codes = np.stack([q & 0xF, q >> 4], axis=-1).reshape(q.shape[0], -1)
    vals = (E2M1[codes & 7] * np.where(codes & 8, -1, 1)).astype(F32)
    return vals * _spread((e4m3_value(s) * g).astype(F32), 1, 16, *vals.shape)


def ue8m0_packed(s: np.ndarray, rows: int) -> np.ndarray:
    """DeepGEMM's MN-major packed UE8M0 layout of power-of-two block scales ``s`` (Nb, Kb) for ``rows`` rows."""
    kb = s.shape[1]
    exps = (s.astype(F32).view(np.uint32) >> 23).astype(np.uint8)
    aligned, words = -(-rows // 4) * 4, -(-kb // 4)
    out = np.zeros((words, aligned), dtype=np.uint32)
    for r in range(rows):
        for j in range(kb):
            out[j // 4, r] |= np.uint32(exps[r // 128, j]) << np.uint32(8 * (j % 4))
    return out.view(np.int32)
