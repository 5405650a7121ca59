"""Where an SGLang scheduler (one TP rank) sits, and its receiver layout from the tables.

SGLang numbers a server's ranks ``pp_rank · tp + tp_rank`` (one scheduler process each); its MoE layers
split experts over ``moe_ep_size`` ranks and TP-split each expert over the rest. The tables model the
two ends: experts TP-split (``ep == 1``) and experts whole (``ep == tp``); anything else, pipeline
parallelism (SGLang's own layer split) and attention-DP are refused with a ``ConfigError`` (the worker
then refits through the model's ``load_weights``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from refitflow.core.errors import ConfigError
from refitflow.integrations.hosting.fused_model import vocab_padding
from refitflow.layouts import fused
from refitflow.layouts import sglang as tables
from refitflow.layouts.canonical import LayoutMap
from refitflow.layouts.rules import Parallel

__all__ = ["Place", "receiver_layout"]


@dataclass(frozen=True, kw_only=True)
class Place:
    tp: int
    tp_rank: int
    pp: int = 1
    pp_rank: int = 0
    ep: int = 1
    attn_tp: int | None = None  # attention TP (smaller than tp with --enable-dp-attention)

    @classmethod
    def current(cls) -> Place:
        """This scheduler's place, from SGLang's runtime context."""
        from sglang.srt.runtime_context import get_parallel

        p = get_parallel()
        return cls(tp=int(p.tp_size), tp_rank=int(p.tp_rank), pp=int(p.pp_size), pp_rank=int(p.pp_rank),
                   ep=int(p.moe_ep_size), attn_tp=int(p.attn_tp_size))  # fmt: skip

    @property
    def rank(self) -> int:
        return self.pp_rank * self.tp + self.tp_rank

    @property
    def size(self) -> int:
        return self.tp * self.pp

    @property
    def name(self) -> str:
        return f"pp{self.pp_rank}-tp{self.tp_rank}"

    def parallel(self) -> Parallel:
        if self.pp > 1:
            raise ConfigError("SGLang's pipeline stages are not in the layout tables")
        if self.attn_tp not in (None, self.tp):
            raise ConfigError("SGLang's attention-DP (attention TP smaller than TP) is not in the layout tables")
        if self.ep not in (1, self.tp):
            raise ConfigError(f"expert parallelism over {self.ep} of {self.tp} ranks is not in the layout tables")
        return fused.parallel(tp=self.tp, tp_rank=self.tp_rank, expert_parallel=self.ep > 1)


def receiver_layout(model: torch.nn.Module, place: Place) -> LayoutMap:
    """This rank's layout from the tables: the model's HF config (SGLang's models keep it as ``model.config``),
    its place, the padding of its vocabulary."""
    config: Any = getattr(model, "config", None)
    if config is None:
        raise ConfigError("the model has no config attribute: its dimensions are unknown")
    try:
        return tables.layout_for(config, place.parallel(), vocab_padding=vocab_padding(model))
    except (AttributeError, TypeError) as exc:
        raise ConfigError(f"cannot read the model's dimensions from its config: {exc}") from exc
