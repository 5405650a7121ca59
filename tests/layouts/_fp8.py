"""FP8 128×128 block helpers for tests, over refitflow's format table (``fp8_block128``)."""

from __future__ import annotations

import torch

from refitflow.layouts.quant import FORMATS
from refitflow.layouts.quant_math import dequantize as _dequantize

FP8 = FORMATS["fp8_block128"]


def scale_name(param: str) -> str:
    return param + FP8.scale_suffix


def scale_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    return FP8.scale_shape(tuple(shape))


def dequantize(q: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    return _dequantize(FP8, q, scale_inv, None)
