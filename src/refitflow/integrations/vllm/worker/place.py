"""Where a vLLM worker sits (its ranks from vLLM's ``ParallelConfig``), and its receiver layout.

vLLM orders a replica's workers as ``(pp, pcp, tp)``, TP fastest (``rank = (pp_rank · pcp + pcp_rank) · tp
+ tp_rank``, ``initialize_model_parallel``), and numbers workers across data-parallel replicas as
``dp_index · world_size + rank`` (as its ``update_info`` lists do). Its MoE layers flatten TP over the
data-parallel and prefill-context-parallel ranks (``FusedMoEParallelConfig.make``: ``dp · pcp · tp``
ranks, rank ``(dp_rank · pcp + pcp_rank) · tp + tp_rank``), which ``layouts.fused.parallel`` takes as
``dp = dp · pcp``. What the tables do not model is refused here with a ``ConfigError`` (the worker then
uses the ``load_weights`` loader): EPLB's redundant experts, ``round_robin`` expert placement.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from refitflow.core.errors import ConfigError
from refitflow.integrations.hosting.fused_model import vocab_padding
from refitflow.layouts import fused
from refitflow.layouts.canonical import LayoutMap
from refitflow.layouts.rules import Parallel

__all__ = ["Place", "receiver_layout"]


@dataclass(frozen=True, kw_only=True)
class Place:
    rank: int  # within the replica
    world: int  # workers of one replica (tp · pcp · pp)
    tp: int
    pp: int = 1
    pcp: int = 1
    dp: int = 1
    dp_index: int = 0
    expert_parallel: bool = False
    eplb: bool = False
    expert_placement: str = "linear"

    @classmethod
    def of(cls, pc: Any) -> Place:
        return cls(
            rank=int(pc.rank), world=int(pc.world_size), tp=int(pc.tensor_parallel_size),
            pp=int(pc.pipeline_parallel_size), pcp=int(getattr(pc, "prefill_context_parallel_size", 1)),
            dp=int(pc.data_parallel_size), dp_index=int(getattr(pc, "data_parallel_index", 0) or 0),
            expert_parallel=bool(pc.enable_expert_parallel), eplb=bool(getattr(pc, "enable_eplb", False)),
            expert_placement=str(getattr(pc, "expert_placement_strategy", "linear")),
        )  # fmt: skip

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def pcp_rank(self) -> int:
        return self.rank // self.tp % self.pcp

    @property
    def pp_rank(self) -> int:
        return self.rank // (self.tp * self.pcp)

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

    def parallel(self) -> Parallel:
        """This worker's place in the fused layout tables (vLLM's placement, ``fused.parallel``)."""
        if self.eplb:
            raise ConfigError("EPLB's redundant experts are not in the layout tables")
        if self.expert_parallel and self.expert_placement != "linear":
            raise ConfigError(f"expert placement {self.expert_placement!r} is not in the layout tables (only 'linear')")
        return fused.parallel(
            tp=self.tp, tp_rank=self.tp_rank, dp=self.dp * self.pcp, dp_rank=self.dp_index * self.pcp + self.pcp_rank,
            expert_parallel=self.expert_parallel, pp=self.pp, pp_rank=self.pp_rank,
        )  # fmt: skip


def receiver_layout(model_config: Any, model: torch.nn.Module, place: Place) -> LayoutMap:
    """This worker's layout from the tables: its model's HF config (``model_config.hf_config``), its place,
    the padding of its vocabulary."""
    hf_config = getattr(model_config, "hf_config", None)
    if hf_config is None:
        raise ConfigError("vLLM's model config has no hf_config: the model's dimensions are unknown")
    try:
        return fused.layout_for(hf_config, place.parallel(), vocab_padding=vocab_padding(model))
    except (AttributeError, TypeError) as exc:
        raise ConfigError(f"cannot read the model's dimensions from its config: {exc}") from exc
