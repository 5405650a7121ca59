"""A request's arguments, each of its type (``ManifestError`` otherwise), and the work checked off the loop."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import anyio
import anyio.to_thread

from refitflow.core.errors import ManifestError

__all__ = ["OFF_LOOP_SHARDS", "arg", "blob_arg", "filters", "off_loop_if", "rows"]

OFF_LOOP_SHARDS = 256  # a manifest (or layout, or offer) with more rows than this is checked in a worker thread
T = TypeVar("T")


def arg(msg: dict[str, Any], name: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
    value = msg.get(name, default)
    if value is ...:
        raise ManifestError(f"request {msg.get('op')!r:.30} lacks {name!r}")
    if value is not default and ((isinstance(value, bool) and kind is not bool) or not isinstance(value, kind)):
        raise ManifestError(f"request argument {name!r} has the wrong type {type(value).__name__}")
    return value


def blob_arg(msg: dict[str, Any], name: str) -> memoryview:
    """A blob argument (``core.wire.Blob``: bytes beside the JSON)."""
    value = msg.get(name)
    if not isinstance(value, memoryview):
        raise ManifestError(f"request {msg.get('op')!r:.30}: {name!r} is a blob of bytes")
    return value


def rows(value: Any) -> int:
    """How many rows a list (a relay offer's tensors or boxes) or a column form (a manifest's shards) holds."""
    if isinstance(value, list):
        return len(value)
    count = value.get("count") if isinstance(value, dict) else None
    return count if type(count) is int else 0


def filters(msg: dict[str, Any]) -> dict[str, Any]:
    targets = arg(msg, "compile_targets", list, None)
    metadata = arg(msg, "metadata", dict, None)
    if targets is not None and not all(isinstance(t, str) for t in targets):
        raise ManifestError("compile_targets must be a list of strings")
    if metadata is not None and not all(isinstance(v, str) for v in metadata.values()):
        raise ManifestError("metadata filter values must be strings")
    skip = arg(msg, "skip", list, [])
    if len(skip) > 64 or not all(type(v) is int for v in skip):
        raise ManifestError("skip is a list of at most 64 version numbers")
    return {"compile_targets": targets, "metadata": metadata, "early": arg(msg, "early", bool, False),
            "skip": skip}  # fmt: skip


async def off_loop_if(big: bool, limiter: anyio.CapacityLimiter, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)``: in a worker thread (at most ``limiter`` at once) when ``big``, else here."""
    if not big:
        return fn(*args)
    return await anyio.to_thread.run_sync(fn, *args, limiter=limiter)
