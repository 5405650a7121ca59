"""Quantised formats as data: how a tensor's values and its scales are stored, and how boxes of one map to
boxes of the other.

A quantised tensor ``W`` is a pair (three tensors for NVFP4): its values (``W``) and its scales
(``W`` + ``scale_suffix``), plus a per-tensor global scale (``W`` + ``global_suffix``) where the format has
one. Every format here dequantises as ``x ≈ value · scale`` (NVFP4: ``value · (scale · global)``), one scale
per block of ``block = (rows, cols)`` elements of the last two dimensions (0: the whole dimension).

=====================  ==============  ==========  =======================  ==================================
format                 values          block       scales (as published)    who serves it
=====================  ==============  ==========  =======================  ==================================
``fp8_block128``       float8_e4m3fn   128 × 128   float32 ``_scale_inv``   DeepSeek-V3, Qwen3 FP8, vLLM
``fp8_block128_pow2``  float8_e4m3fn   128 × 128   float32 ``_scale_inv``,  DeepGEMM on Blackwell (UE8M0)
                                                   powers of two
``fp8_channel``        float8_e4m3fn   1 × row     float32 ``_scale``       compressed-tensors channel FP8
``mxfp8``              float8_e4m3fn   1 × 32      uint8 E8M0 ``_scale``    OCP MX (Blackwell MXFP8)
``nvfp4``              uint8 (2 × e2m1) 1 × 16     float8_e4m3fn ``_scale`` NVIDIA ModelOpt NVFP4
                                                   + float32 ``_scale_2``
=====================  ==============  ==========  =======================  ==================================

A receiver may *store* a format's scales otherwise: ``fp8_block128_ue8m0`` is ``fp8_block128_pow2`` with
SGLang's DeepGEMM layout (each row's E8M0 exponents, four to an int32, MN-major, rows padded to a multiple of
4: an int32 tensor ``(ceil(ceil(K/128)/4), align4(N))``). Same ``logical`` format: copied, never re-quantised.
The maths is in ``layouts/quant_math.py``, how scales follow their values' layouts in
``layouts/quant_layout.py``; which format a tensor is in is read off its dtypes and shapes (``detect``), or
declared.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import orjson
import torch

from refitflow.core.dtypes import dtype_name, known_name
from refitflow.core.errors import ConfigError, ManifestError

__all__ = ["FORMATS", "QuantFormat", "QuantParam", "declared_quant", "detect"]


@dataclass(frozen=True)
class QuantFormat:
    name: str
    values: torch.dtype  # how values are stored
    per_value: int  # elements per stored value along the last dimension (2: two e2m1 in a byte)
    block: tuple[int, int]  # elements per scale, (rows, cols) of the last two dimensions; 0: the whole dimension
    scale: torch.dtype  # how the scales are published (the canonical storage)
    scale_suffix: str
    global_suffix: str | None = None  # a per-tensor float32 scale (NVFP4)
    storage: str = "canonical"  # how a receiver stores the scales: "canonical" or "ue8m0_packed"
    logical: str = ""  # formats with the same logical name hold the same numbers (default: the name)

    @property
    def same(self) -> str:
        return self.logical or self.name

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The canonical scales' shape for values of ``shape`` (stored units)."""
        *lead, rows, cols = shape
        (br, bc), cols = self.block, cols * self.per_value
        return (*lead, -(-rows // br) if br else 1, -(-cols // bc) if bc else 1)

    def stored_scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The scales' shape as this format stores them (``ue8m0_packed``: int32 words, MN-major)."""
        s = self.scale_shape(shape)
        if self.storage == "ue8m0_packed":
            return (*s[:-2], -(-s[-1] // 4), -(-shape[-2] // 4) * 4)
        return s

    @property
    def stored_scale_dtype(self) -> torch.dtype:
        return torch.int32 if self.storage == "ue8m0_packed" else self.scale

    def global_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(shape[:-2])

    def elements(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape in elements of values stored in ``shape``."""
        return (*shape[:-1], shape[-1] * self.per_value)


_E4M3 = torch.float8_e4m3fn
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
FORMATS: dict[str, QuantFormat] = {
    f.name: f
    for f in (
        QuantFormat("fp8_block128", _E4M3, 1, (128, 128), torch.float32, "_scale_inv"),
        QuantFormat("fp8_block128_pow2", _E4M3, 1, (128, 128), torch.float32, "_scale_inv"),
        QuantFormat(
            "fp8_block128_ue8m0",
            _E4M3,
            1,
            (128, 128),
            torch.float32,
            "_scale_inv",
            storage="ue8m0_packed",
            logical="fp8_block128_pow2",
        ),
        QuantFormat("fp8_channel", _E4M3, 1, (1, 0), torch.float32, "_scale"),
        QuantFormat("mxfp8", _E4M3, 1, (1, 32), torch.uint8, "_scale"),
        QuantFormat("nvfp4", torch.uint8, 2, (1, 16), _E4M3, "_scale", global_suffix="_scale_2"),
    )
}


@dataclass(frozen=True)
class QuantParam:
    """A quantised tensor: its format and the names of its values, scales and global scale."""

    format: QuantFormat
    values: str
    scale: str
    global_: str | None = None

    @property
    def derived(self) -> tuple[str, ...]:
        """The tensors besides the values."""
        return (self.scale,) if self.global_ is None else (self.scale, self.global_)


def _fits(fmt: QuantFormat, name: str, tensors: Mapping[str, torch.Tensor]) -> QuantParam | None:
    """``name`` as a quantised tensor of ``fmt``, when its dtypes and its partners' names and shapes say so."""
    v = tensors[name]
    if v.dtype != fmt.values or v.dim() < 2:
        return None
    s = tensors.get(name + fmt.scale_suffix)
    if s is None or s.dtype != fmt.stored_scale_dtype or tuple(s.shape) != fmt.stored_scale_shape(tuple(v.shape)):
        return None
    g = None
    if fmt.global_suffix is not None:
        g = tensors.get(name + fmt.global_suffix)
        want = fmt.global_shape(tuple(v.shape))
        if g is None or g.dtype != torch.float32 or tuple(g.shape) not in (want, want or (1,)):
            return None
    return QuantParam(fmt, name, name + fmt.scale_suffix, None if g is None else name + fmt.global_suffix)  # type: ignore[operator]


def detect(
    tensors: Mapping[str, torch.Tensor], declared: Mapping[str, str] | None = None, *, strict: bool = True
) -> dict[str, QuantParam]:
    """The quantised tensors among ``tensors``: values name -> ``QuantParam``.

    A float8 (or uint8) tensor with partners of the right names, dtypes and shapes is quantised in that format
    (the first that fits, in ``FORMATS`` order: ``fp8_block128`` before its power-of-two variant, which must
    be declared); ``declared`` names a tensor's format where the dtypes alone cannot tell.
    A declared tensor that does not fit its format is a ``ConfigError``; so is a float8 tensor that fits no
    format (``strict``: a receiver's, which must know what to write its scales into) — a publisher's is
    published as plain bytes.
    """
    declared = dict(declared or {})
    out: dict[str, QuantParam] = {}
    for name, fmt_name in declared.items():
        fmt = FORMATS.get(fmt_name)
        if fmt is None:
            raise ConfigError(f"unknown quantised format {fmt_name!r} for {name!r}; known: {sorted(FORMATS)}")
        if name not in tensors:
            raise ConfigError(f"{name!r} is declared {fmt_name} but there is no such tensor")
        found = _fits(fmt, name, tensors)
        if found is None:
            raise ConfigError(_wants(fmt, name, tensors[name]))
        out[name] = found
    for name, t in tensors.items():
        if name in out or t.dtype not in (*_FP8, torch.uint8):
            continue
        found = next((q for f in FORMATS.values() if (q := _fits(f, name, tensors)) is not None), None)
        if found is not None:
            out[name] = found
    partners = {n for q in out.values() for n in q.derived}
    lone = [n for n, t in tensors.items() if t.dtype in _FP8 and n not in out and n not in partners]
    if lone and strict:  # a float8 tensor without its scales: nobody could say what its numbers are
        name, t, fmt = lone[0], tensors[lone[0]], FORMATS["fp8_block128"]
        others: dict[str, list[str]] = {}
        for f in FORMATS.values():
            if f.values == t.dtype and f is not fmt:
                others.setdefault(name + f.scale_suffix, []).append(f.name)
        hint = "; ".join(f"{n!r} for {', '.join(fs)}" for n, fs in others.items())
        raise ConfigError(f"{_wants(fmt, name, t)}; or {hint} (layouts/quant.py); or declare it with quant=")
    return out


def _wants(fmt: QuantFormat, name: str, t: torch.Tensor) -> str:
    if t.dim() < 2 or t.dtype != fmt.values:
        return (f"{fmt.name} tensor {name!r} must be {dtype_name(fmt.values)} with at least 2 dimensions, "
                f"got {known_name(t.dtype) or t.dtype} {tuple(t.shape)}")  # fmt: skip
    shape = tuple(t.shape)
    scale = dtype_name(fmt.stored_scale_dtype)
    text = (f"{fmt.name} tensor {name!r} needs a {scale} {name + fmt.scale_suffix!r} of shape "
            f"{fmt.stored_scale_shape(shape)} (blocks of {fmt.block})")  # fmt: skip
    if fmt.global_suffix:
        text += f" and a float32 {name + fmt.global_suffix!r} of shape {fmt.global_shape(shape)}"
    return text


def declared_quant(text: str | None, version: int | None = None) -> dict[str, QuantFormat]:
    """A manifest's ``metadata["quant"]`` (JSON: published name -> format name) as formats."""
    if not text:
        return {}
    try:
        doc = orjson.loads(text)
        return {str(name): FORMATS[fmt] for name, fmt in doc.items()}
    except (orjson.JSONDecodeError, AttributeError, KeyError, TypeError) as exc:
        raise ManifestError(f"bad quant metadata ({type(exc).__name__}: {exc}); formats: {sorted(FORMATS)}",
                            version=version) from None  # fmt: skip
