"""Where a vLLM worker sits (its ranks from vLLM's ``ParallelConfig``), and the model's dimensions.

vLLM orders a replica's workers TP-fastest (``rank = pp_rank · tp + tp_rank``) and numbers workers
across data-parallel replicas as ``dp_index · world_size + rank`` (as its ``update_info`` lists do).
MoE experts: with expert parallelism each of the ``dp · tp`` workers holds whole experts
(EP rank ``dp_index · tp + tp_rank``); without it vLLM slices every expert across all ``dp · tp``
workers, which the layout tables express only for ``dp == 1``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from refitflow.core.errors import ConfigError
from refitflow.layouts.canonical import ModelDims
from refitflow.layouts.hf import dims_from_config
from refitflow.layouts.rules import Parallel

__all__ = ["Place", "expert_family", "model_dims"]


@dataclass(frozen=True, kw_only=True)
class Place:
    rank: int  # within the replica
    world: int  # workers of one replica (tp · pp · pcp)
    tp: int
    dp: int
    dp_index: int
    expert_parallel: bool

    @classmethod
    def of(cls, pc: Any) -> Place:
        return cls(
            rank=int(pc.rank), world=int(pc.world_size), tp=int(pc.tensor_parallel_size),
            dp=int(pc.data_parallel_size), dp_index=int(getattr(pc, "data_parallel_index", 0) or 0),
            expert_parallel=bool(pc.enable_expert_parallel),
        )  # fmt: skip

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def global_rank(self) -> int:
        return self.dp_index * self.world + self.rank

    @property
    def vote_size(self) -> int:
        """Workers voting together: every worker of every replica (one API server updates them all)."""
        return self.world * self.dp

    @property
    def name(self) -> str:
        return f"dp{self.dp_index}-rank{self.rank}"

    def parallel(self, dims: ModelDims) -> Parallel:
        """This worker's place for the fused layout table."""
        if not dims.experts:
            return Parallel(tp=self.tp, tp_rank=self.tp_rank)
        if self.expert_parallel:
            return Parallel(tp=self.tp, tp_rank=self.tp_rank, ep=self.dp * self.tp,
                            ep_rank=self.dp_index * self.tp + self.tp_rank, expert_tp=1)  # fmt: skip
        if self.dp > 1:
            raise ConfigError("MoE experts sliced across data-parallel replicas (dp > 1 without expert parallelism)")
        return Parallel(tp=self.tp, tp_rank=self.tp_rank)


def model_dims(model_config: Any) -> ModelDims:
    """The layout dimensions of vLLM's model (its ``model_config.hf_config``, a transformers config)."""
    hf_config = getattr(model_config, "hf_config", None)
    if hf_config is None:
        raise ConfigError("vLLM's model config has no hf_config: the model's dimensions are unknown")
    try:
        return dims_from_config(hf_config)
    except (AttributeError, TypeError) as exc:
        raise ConfigError(f"cannot read the model's dimensions from its config: {exc}") from exc


def expert_family(names: Iterable[str]) -> str:
    """The checkpoint naming of experts the model's ``load_weights`` takes (``load_weights.EXPERT_NAMES``)."""
    return "block_sparse_moe" if any(".block_sparse_moe." in n for n in names) else "mlp"
