"""refitflow as SGLang's custom weight loader (``--custom-weight-loader refitflow.integrations.sglang.loader.refit``).

- ``loader.refit``: the loader SGLang runs in every scheduler (TP rank) inside ``/update_weights_from_tensor``;
- ``plugin.register``: the ``sglang.srt.plugins`` entry point whose hook turns a failed refit into SGLang's
  ``{"success": false, "message": ...}`` answer (SGLang would stop the scheduler on a loader's exception);
- ``payload``: what the driver sends (``encode``) and the loader reads (``decode``), host-independent;
- ``driver.SglangFleet``: drives SGLang servers over their HTTP routes (needs httpx, not SGLang);
- ``place``: a rank's place from SGLang's runtime context, its receiver layout.

Names are imported on first use, so the driver and the payload work without SGLang installed.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["LOADER", "SglangFleet", "decode", "encode", "refit", "register"]

_WHERE = {
    "LOADER": "payload",
    "SglangFleet": "driver",
    "decode": "payload",
    "encode": "payload",
    "refit": "loader",
    "register": "plugin",
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
