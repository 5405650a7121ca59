"""refitflow as a verl checkpoint-engine backend, ``refitflow`` (``docs/verl.md``).

A verl config selects it with ``actor_rollout_ref.rollout.checkpoint_engine.backend=refitflow`` and
``custom_backend_module=refitflow.integrations.verl``: verl imports this package on every worker,
which registers the backend with verl's ``CheckpointEngineRegistry`` (``backend.py``; imports verl).

- ``config``: the backend's settings, verl's ``engine_kwargs.refitflow`` (plain data);
- ``trainer``: each actor rank publishes its part of a version (DTensor shards in place, or its rows
  of whole tensors), then waits for the inference ranks to be done with it;
- ``rollout``: each inference server refits itself through refitflow's vLLM backend.
"""

from __future__ import annotations

from refitflow.integrations.verl.backend import BACKEND, RefitflowCheckpointEngine
from refitflow.integrations.verl.config import VerlBackendConfig

__all__ = ["BACKEND", "RefitflowCheckpointEngine", "VerlBackendConfig"]
