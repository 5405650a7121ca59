"""The dtypes refitflow moves, by their wire names. An unknown dtype is an error, never a default."""

from __future__ import annotations

import torch

from refitflow.core.errors import PlanError

__all__ = ["dtype_from_name", "dtype_name", "itemsize", "known_name", "known_names"]

_BY_NAME: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_BY_DTYPE = {v: k for k, v in _BY_NAME.items()}
_NAMES = frozenset(_BY_NAME)


def dtype_from_name(name: str, *, tensor: str | None = None) -> torch.dtype:
    try:
        return _BY_NAME[name]
    except (KeyError, TypeError):
        raise PlanError(f"unknown dtype {name!r}; known: {sorted(_BY_NAME)}", tensor=tensor) from None


def dtype_name(dtype: torch.dtype, *, tensor: str | None = None) -> str:
    try:
        return _BY_DTYPE[dtype]
    except KeyError:
        raise PlanError(f"unsupported dtype {dtype}", tensor=tensor) from None


def known_name(dtype: torch.dtype) -> str | None:
    """The wire name of ``dtype``, None when refitflow does not move it."""
    return _BY_DTYPE.get(dtype)


def known_names() -> frozenset[str]:
    """Every dtype name refitflow moves."""
    return _NAMES


def itemsize(name: str) -> int:
    return dtype_from_name(name).itemsize
