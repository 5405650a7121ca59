"""TRL's ``GRPOTrainer`` and ``GRPOConfig`` with one more config value: ``weight_sync_backend``.

    from refitflow.integrations.trl import GRPOConfig, GRPOTrainer      # instead of ``from trl import ...``

    args = GRPOConfig(use_vllm=True, vllm_mode="server", vllm_server_base_url="http://inference-0:8000",
                      weight_sync_backend="refitflow", refitflow={"model": "qwen3-8b"})
    GRPOTrainer(model=..., reward_funcs=..., args=args, train_dataset=...).train()

``weight_sync_backend="nccl"`` (the default) is TRL's own trainer, unchanged. ``"refitflow"`` builds
``generation.RefitflowVLLMGeneration`` where TRL builds its ``VLLMGeneration`` (TRL has no seam for it: the name is
swapped in ``trl.trainer.grpo_trainer`` for the duration of the constructor only). On the command line (TRL's
``TrlParser``): ``--weight_sync_backend refitflow --refitflow '{"model": "qwen3-8b"}'``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import trl
import trl.trainer.grpo_trainer as grpo_module

from refitflow.core.errors import ConfigError
from refitflow.integrations.trl.generation import RefitflowVLLMGeneration
from refitflow.integrations.trl.options import BACKENDS, RefitflowTrl

__all__ = ["GRPOConfig", "GRPOTrainer"]

_SWAP = threading.Lock()  # one constructor at a time swaps TRL's module attribute


@dataclass
class GRPOConfig(trl.GRPOConfig):
    weight_sync_backend: str = field(
        default="nccl",
        metadata={"help": "How the trainer's weights reach the vLLM server in server mode: 'nccl' (TRL's own) or "
                          "'refitflow' (every rank publishes its shards; the server pulls, verifies and swaps them "
                          "in without draining).", "choices": list(BACKENDS)},
    )
    refitflow: dict[str, Any] | str | None = field(
        default=None,
        metadata={"help": "refitflow's options (refitflow.integrations.trl.RefitflowTrl fields), a dict or JSON."},
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.weight_sync_backend not in BACKENDS:
            raise ConfigError(f"weight_sync_backend must be one of {list(BACKENDS)}, got {self.weight_sync_backend!r}")
        if isinstance(self.refitflow, str):
            self.refitflow = json.loads(self.refitflow)
        if self.weight_sync_backend == "refitflow":
            if not self.use_vllm or self.vllm_mode != "server":
                raise ConfigError("weight_sync_backend='refitflow' needs use_vllm=True and vllm_mode='server'")
            RefitflowTrl.parse(self.refitflow)  # a bad option fails here, not at the first sync


class GRPOTrainer(trl.GRPOTrainer):
    """``trl.GRPOTrainer``; with ``args.weight_sync_backend == "refitflow"`` its vLLM generation is refitflow's."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        bound = inspect.signature(trl.GRPOTrainer.__init__).bind(self, *args, **kwargs)
        config = bound.arguments.get("args")
        if getattr(config, "weight_sync_backend", "nccl") != "refitflow":
            super().__init__(*args, **kwargs)
            return
        options = RefitflowTrl.parse(getattr(config, "refitflow", None))
        with _generation(functools.partial(RefitflowVLLMGeneration, refitflow=options)):
            super().__init__(*args, **kwargs)

    @property
    def refitflow(self) -> RefitflowVLLMGeneration:
        generation = getattr(self, "vllm_generation", None)
        if not isinstance(generation, RefitflowVLLMGeneration):
            raise ConfigError("this trainer does not sync through refitflow (weight_sync_backend != 'refitflow')")
        return generation

    def train(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().train(*args, **kwargs)
        finally:
            generation = getattr(self, "vllm_generation", None)
            if isinstance(generation, RefitflowVLLMGeneration):
                generation.close()


@contextlib.contextmanager
def _generation(factory: Any) -> Iterator[None]:
    with _SWAP:
        before = grpo_module.VLLMGeneration
        grpo_module.VLLMGeneration = factory  # type: ignore[misc]
        try:
            yield
        finally:
            grpo_module.VLLMGeneration = before  # type: ignore[misc]
