"""Which writer an engine's worker refits with: ``direct`` (the layout tables map every parameter) or the
model's own ``load_weights`` — shared by the vLLM and SGLang integrations.

``choose(loader, params, layout, model)``: with ``loader`` ``auto`` the direct writer when ``layout()`` (this
worker's layout from the tables) maps every parameter of ``params``, else ``load_weights``; ``direct`` refuses
a model that does not map; ``load_weights`` is taken as asked.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch

from refitflow.core.errors import ConfigError
from refitflow.integrations.fused_model import derive
from refitflow.integrations.load_weights import load_weights_writer
from refitflow.integrations.rank_session import Build, direct_writer
from refitflow.layouts.canonical import LayoutMap

__all__ = ["choose", "expert_family"]

log = logging.getLogger(__name__)


def choose(loader: str, params: list[tuple[str, torch.Tensor]], layout: Callable[[], LayoutMap],
           model: Any) -> tuple[str, Build]:  # fmt: skip
    """``("direct" | "load_weights", build)`` for ``RankSession.open``; a ``ConfigError`` saying why when neither
    can refit ``model``."""
    why = "loader='load_weights' asked for"
    if loader != "load_weights":
        try:
            derived = derive(params, layout())
            if derived.complete:
                return "direct", direct_writer(derived)
            why = f"parameters the layout tables do not map: {derived.why()}"
        except ConfigError as exc:
            why = str(exc)
        if loader == "direct":
            raise ConfigError(f"loader='direct' but the model does not map: {why}")
    load = getattr(model, "load_weights", None)
    if load is None:
        raise ConfigError(f"the model has no load_weights and cannot be mapped ({why})")
    log.info("refitflow: using the model's load_weights (%s)", why)
    return "load_weights", load_weights_writer(params, load, expert_family(name for name, _ in params))


def expert_family(names: Iterable[str]) -> str:
    """The checkpoint naming of experts the model's ``load_weights`` takes (``load_weights.EXPERT_NAMES``)."""
    return "block_sparse_moe" if any(".block_sparse_moe." in n for n in names) else "mlp"
