"""A layout in a manifest: ``metadata["layout"]`` = compact JSON (name, dims, parallel place).

The receiver recomputes the publisher's segments from the same tables, so the manifest stays small.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from functools import lru_cache

from refitflow.core.errors import ManifestError
from refitflow.layouts import fused, hf, megatron
from refitflow.layouts.canonical import LayoutMap, ModelDims, canonical_shapes
from refitflow.layouts.rules import Parallel

__all__ = ["LAYOUTS", "layout_metadata", "resolve"]

LAYOUTS = {
    "megatron": megatron.layout,
    "fused": fused.layout,
    "hf": lambda d, par: hf.layout(d),
    "hf_legacy": lambda d, par: hf.layout(d, legacy_experts=True),
}


def layout_metadata(name: str, dims: ModelDims, par: Parallel) -> dict[str, str]:
    """The manifest metadata that names this rank's layout."""
    if name not in LAYOUTS:
        raise ManifestError(f"unknown layout {name!r}; known: {sorted(LAYOUTS)}")
    text = json.dumps({"name": name, "dims": asdict(dims), "par": asdict(par)}, sort_keys=True, separators=(",", ":"))
    return {"layout": text}


@lru_cache(maxsize=64)
def resolve(text: str) -> tuple[LayoutMap, dict[str, tuple[int, ...]]]:
    """The layout map a manifest's ``metadata["layout"]`` describes, and the canonical shapes (cached)."""
    try:
        d = json.loads(text)
        build = LAYOUTS[d["name"]]
        dims = ModelDims(**d["dims"])
        return build(dims, Parallel(**d["par"])), canonical_shapes(dims)
    except (KeyError, TypeError, ValueError) as exc:
        raise ManifestError(f"bad layout metadata: {type(exc).__name__}: {exc}") from exc
