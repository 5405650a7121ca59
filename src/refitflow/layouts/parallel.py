"""One rank's place in a model's parallelism: tensor, expert, expert-tensor and pipeline parallel ranks."""

from __future__ import annotations

from dataclasses import dataclass

from refitflow.core.errors import ConfigError

__all__ = ["Parallel"]


@dataclass(frozen=True, kw_only=True)
class Parallel:
    """One rank's place: tensor, expert, expert tensor (default: tp) and pipeline parallel.

    The expert-TP rank is ``tp_rank % expert_tp`` unless ``expert_tp_rank`` says otherwise (vLLM
    flattens the experts' TP over its data-parallel ranks, so there it can exceed ``tp``).
    """

    tp: int = 1
    tp_rank: int = 0
    ep: int = 1
    ep_rank: int = 0
    expert_tp: int | None = None
    expert_tp_rank: int | None = None
    pp: int = 1
    pp_rank: int = 0

    def __post_init__(self) -> None:
        if not (0 <= self.tp_rank < self.tp and 0 <= self.ep_rank < self.ep and 0 <= self.pp_rank < self.pp):
            raise ConfigError(f"parallel ranks outside their sizes: {self}")
        if self.expert_tp_rank is None and self.tp % self.etp:
            raise ConfigError("expert_tp must divide tp (or give expert_tp_rank)")
        if not 0 <= self.etp_rank < self.etp:
            raise ConfigError(f"expert_tp_rank outside expert_tp: {self}")

    @property
    def etp(self) -> int:
        return self.tp if self.expert_tp is None else self.expert_tp

    @property
    def etp_rank(self) -> int:
        return self.tp_rank % self.etp if self.expert_tp_rank is None else self.expert_tp_rank
