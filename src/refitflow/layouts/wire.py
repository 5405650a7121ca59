"""A layout in a manifest: ``metadata["layout"]`` = compact JSON (name, dims, parallel place, options).

The receiver recomputes the publisher's segments from the same tables, so the manifest stays small.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from dataclasses import asdict
from functools import lru_cache, partial
from typing import Any

from refitflow.core.errors import ConfigError, ManifestError
from refitflow.layouts import fused, hf, megatron, sglang
from refitflow.layouts.canonical import LayoutMap, ModelDims
from refitflow.layouts.rules import Only, Parallel, shapes_of

__all__ = ["LAYOUTS", "layout_metadata", "resolve", "resolve_only", "shapes"]


def _hf(d: ModelDims, par: Parallel, *, experts: str = "fused", only: Only | None = None) -> LayoutMap:
    return hf.layout(d, experts=experts, only=only)


LAYOUTS: dict[str, Callable[..., LayoutMap]] = {
    "megatron": megatron.layout,
    "fused": fused.layout,
    "sglang": sglang.layout,
    "hf": _hf,
    "hf_legacy": partial(_hf, experts="mixtral"),
}
# the layouts that can be built in part (``rules.Only``: those that may have one entry per expert)
_IN_PART = tuple(f for f in LAYOUTS.values() if "only" in inspect.signature(f).parameters)


def layout_metadata(name: str, dims: ModelDims, par: Parallel, **options: Any) -> dict[str, str]:
    """The manifest metadata that names this rank's layout; ``options`` are the layout function's keywords
    (``vocab_divisible_by=``, ``spec=``, ``experts=``, ``vocab_padding=``...)."""
    if name not in LAYOUTS:
        raise ManifestError(f"unknown layout {name!r}; known: {sorted(LAYOUTS)}")
    if "only" in options:
        raise ConfigError("only= builds a layout in part for planning: it is not a layout option")
    doc: dict[str, Any] = {"name": name, "dims": asdict(dims), "par": asdict(par)}
    if options:
        doc["options"] = options
    try:  # an unknown option fails here, at the publisher, not at every receiver
        inspect.signature(LAYOUTS[name]).bind(dims, par, **options)
    except TypeError as exc:
        raise ConfigError(f"layout {name!r} does not take these options: {exc}") from exc
    return {"layout": json.dumps(doc, sort_keys=True, separators=(",", ":"))}


@lru_cache(maxsize=256)
def _parsed(text: str) -> tuple[Callable[..., LayoutMap], ModelDims, Parallel, dict[str, Any]]:
    try:
        d = json.loads(text)
        return LAYOUTS[d["name"]], ModelDims(**d["dims"]), Parallel(**d["par"]), d.get("options", {})
    except (KeyError, TypeError, ValueError) as exc:
        raise ManifestError(f"bad layout metadata: {type(exc).__name__}: {exc}") from exc


def _built(text: str, **only: Only) -> LayoutMap:
    build, dims, par, options = _parsed(text)
    try:
        return build(dims, par, **options, **only)
    except (KeyError, TypeError, ValueError) as exc:
        raise ManifestError(f"bad layout metadata: {type(exc).__name__}: {exc}") from exc


@lru_cache(maxsize=64)
def resolve(text: str) -> tuple[LayoutMap, dict[str, tuple[int, ...]]]:
    """The layout map a manifest's ``metadata["layout"]`` describes, and the canonical shapes (cached)."""
    return _built(text), shapes(text)


def shapes(text: str) -> dict[str, tuple[int, ...]]:
    """The canonical shapes of the model ``metadata["layout"] == text`` describes (shared: do not change it)."""
    return shapes_of(_parsed(text)[1])


def resolve_only(text: str, only: Only) -> LayoutMap:
    """The layout ``text`` describes built in part (``rules.Only``: of its per-expert entries, those read), not
    cached: the caller keeps it. A layout that never has per-expert entries (stacked experts) is ``resolve``'s."""
    if _parsed(text)[0] in _IN_PART:
        return _built(text, only=only)
    return resolve(text)[0]
