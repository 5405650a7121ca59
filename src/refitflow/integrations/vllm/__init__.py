"""refitflow as a vLLM weight-transfer backend (``--weight-transfer-config '{"backend": "refitflow"}'``).

By process role:

- ``worker/``: inside each vLLM worker — ``backend.RefitflowEngine`` (the backend, imports vLLM), where the
  worker sits (``place``), which layers a refit writes directly (``kernels``, ``mla``) and how the others are
  reloaded (``reload``, ``reprocessing``), LoRA landings (``lora``);
- ``server/``: inside vLLM's server and engine core — the entry points (``plugin.register``: the
  ``vllm.general_plugins`` hook that registers the backend; ``endpoints``: the readiness route and the join),
  the serving gate (``gate``), no-drain updates (``nodrain``), calls to the workers (``workers``);
- ``trainer/``: the trainer side, ``backend`` (vLLM's ``WeightTransferTrainerFactory`` engine);
- ``driver/``: the RL loop's side — ``fleet.VllmFleet`` (drives servers over their RL routes; needs httpx,
  not vLLM), ``checksums`` (``/weight_checker``-compatible), ``versions`` (which weight version produced
  each output token: ``policy_mask``, ``token_versions``).

The init and update info the RL loop sends are engine-neutral data: ``integrations/hosting/info.py``.

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
    "RefitflowEngine": "refitflow.integrations.vllm.worker.backend",
    "RefitflowInitInfo": "refitflow.integrations.hosting.info",
    "RefitflowUpdateInfo": "refitflow.integrations.hosting.info",
    "ServerError": "refitflow.integrations.vllm.driver.fleet",
    "VllmFleet": "refitflow.integrations.vllm.driver.fleet",
    "expected_checksums": "refitflow.integrations.vllm.driver.checksums",
    "policy_mask": "refitflow.integrations.vllm.driver.versions",
    "register": "refitflow.integrations.vllm.server.plugin",
    "token_versions": "refitflow.integrations.vllm.driver.versions",
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)
