"""refitflow as a vLLM weight-transfer backend (``--weight-transfer-config '{"backend": "refitflow"}'``).

- ``engine.RefitflowEngine``: the backend, one per vLLM worker (imports vLLM);
- ``plugin.register``: the ``vllm.general_plugins`` entry point that registers it;
- ``info``: its init and update info (plain data: what the RL loop sends);
- ``driver.VllmFleet``: drives vLLM servers over their RL routes (needs httpx, not vLLM);
- ``checksums``: ``/weight_checker``-compatible checksums of what a commit must hold;
- ``place``: a worker's ranks from vLLM's parallel config, the model's dimensions;
- ``versions``: which weight version produced each output token (``policy_mask``, ``token_versions``).

Names are imported on first use, so the driver and the info classes work without vLLM installed.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "RefitflowEngine",
    "RefitflowInitInfo",
    "RefitflowUpdateInfo",
    "ServerError",
    "VllmFleet",
    "expected_checksums",
    "policy_mask",
    "register",
    "token_versions",
]

_WHERE = {
    "RefitflowEngine": "engine",
    "RefitflowInitInfo": "info",
    "RefitflowUpdateInfo": "info",
    "ServerError": "driver",
    "VllmFleet": "driver",
    "expected_checksums": "checksums",
    "policy_mask": "versions",
    "register": "plugin",
    "token_versions": "versions",
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
