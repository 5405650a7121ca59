"""The options of refitflow's TRL weight sync (plain data: no TRL, no vLLM)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Self

from refitflow.core.errors import ConfigError

__all__ = ["BACKENDS", "RefitflowTrl"]

BACKENDS = ("nccl", "refitflow")  # GRPOConfig.weight_sync_backend: TRL's own NCCL sync, or refitflow's


@dataclass
class RefitflowTrl:
    """What ``GRPOConfig(weight_sync_backend="refitflow", refitflow={...})`` may set (every field optional)."""

    model: str = "policy"  # the publication's identity: model name
    registry: str | None = None  # a refitflow registry service; None: the main process serves one
    registry_bind: str = "tcp://0.0.0.0:*"  # where the main process's registry binds
    advertise_host: str | None = None  # the host the server reaches the registry at (default: as bound)
    worker_init: dict[str, Any] = field(default_factory=dict)  # more of the server backend's init info
    max_lag: int = 0  # a completion's tokens may come from weights this many versions behind the trainer's
    timeout_s: float = 600.0  # one sync (publish, the server's update, the release); one generation's retries

    def __post_init__(self) -> None:
        if self.max_lag < 0:
            raise ConfigError(f"refitflow.max_lag must be >= 0, got {self.max_lag}")
        if self.timeout_s <= 0:
            raise ConfigError(f"refitflow.timeout_s must be > 0, got {self.timeout_s}")
        taken = {"registry", "model", "identity", "mode", "shadow_commit"} & set(self.worker_init)
        if taken:
            raise ConfigError(f"refitflow.worker_init may not set {sorted(taken)}: the weight sync sets them")

    @classmethod
    def parse(cls, value: object) -> Self:
        if isinstance(value, RefitflowTrl):
            return value  # type: ignore[return-value]
        if value is not None and not isinstance(value, Mapping):
            raise ConfigError(f"the refitflow options are a mapping of RefitflowTrl fields, got {value!r}")
        known = {f.name for f in fields(cls)}
        given = dict(value or {})
        unknown = sorted(set(given) - known)
        if unknown:
            raise ConfigError(f"unknown refitflow option(s) {unknown}; known: {sorted(known)}")
        return cls(**given)
