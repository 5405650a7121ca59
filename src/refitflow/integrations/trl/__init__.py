"""refitflow in TRL's RL loops (``docs/trl.md``): GRPO in vLLM server mode with refitflow as the weight sync.

- ``grpo``: ``GRPOConfig`` / ``GRPOTrainer``, TRL's own classes with one more config value,
  ``weight_sync_backend="refitflow"`` (and ``refitflow`` options); TRL's NCCL sync is the default;
- ``generation``: what that value switches: every trainer rank publishes its parameters (DTensor shards in place, no
  gather) after each optimizer step, the main process drives the server's no-drain update, and each completion is
  generated under a minimum weight version and carries the versions that produced its tokens;
- ``async_grpo``: ``RefitflowWeightTransfer``, the ``weight_transfer=`` of TRL's experimental ``AsyncGRPOTrainer``;
- ``options``: the options (plain data).

Names are imported on first use (``trl`` and ``vllm`` are needed by ``grpo``, ``generation``, ``async_grpo``).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["GRPOConfig", "GRPOTrainer", "RefitflowTrl", "RefitflowVLLMGeneration", "RefitflowWeightTransfer"]

_WHERE = {
    "GRPOConfig": "grpo",
    "GRPOTrainer": "grpo",
    "RefitflowTrl": "options",
    "RefitflowVLLMGeneration": "generation",
    "RefitflowWeightTransfer": "async_grpo",
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
