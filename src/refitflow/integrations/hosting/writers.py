"""Which writer an engine's worker refits with: ``direct`` (the layout tables map every parameter) or the
model's own ``load_weights`` — shared by the vLLM and SGLang integrations.

``choose(loader, params, layout, model)``: with ``loader`` ``auto`` the direct writer when ``layout()`` (this
worker's layout from the tables) maps every parameter of ``params``, else ``load_weights``; ``direct`` refuses
a model that does not map; ``load_weights`` is taken as asked. The ``Choice`` says which, and why.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch

from refitflow.core.errors import ConfigError
from refitflow.integrations.hosting.fused_model import derive
from refitflow.integrations.hosting.load_weights import load_weights_writer
from refitflow.integrations.hosting.rank_session import Build, direct_writer
from refitflow.layouts.canonical import LayoutMap

__all__ = ["Choice", "choose", "expert_family"]

log = logging.getLogger(__name__)


class Choice(NamedTuple):
    loader: str  # "direct" or "load_weights"
    build: Build  # for RankSession.open
    why: str  # why this loader, in words (for the server's log and error messages)


def choose(loader: str, params: list[tuple[str, torch.Tensor]], layout: Callable[[], LayoutMap],
           model: Any, *, live: list[tuple[str, torch.Tensor]] | None = None, load: Any = None,
           refused: str = "") -> Choice:  # fmt: skip
    """The writer for ``RankSession.open``, and why; a ``ConfigError`` saying why when neither
    can refit ``model``. ``params``: what the direct writer writes; ``live``: the model's parameters
    ``load_weights`` reports (default ``params``); ``load``: the loader (default ``model.load_weights``);
    ``refused``: why the direct writer cannot take the model whatever the layout says."""
    why = "loader='load_weights' asked for"
    if loader != "load_weights" and refused:
        why = refused
        if loader == "direct":
            raise ConfigError(f"loader='direct' but the model does not map: {why}")
    elif loader != "load_weights":
        try:
            derived = derive(params, layout())
            if derived.complete:
                return Choice("direct", direct_writer(derived), "every parameter maps in the layout tables")
            why = f"parameters the layout tables do not map: {derived.why()}"
        except ConfigError as exc:
            why = str(exc)
        if loader == "direct":
            raise ConfigError(f"loader='direct' but the model does not map: {why}")
    load = load if load is not None else getattr(model, "load_weights", None)
    if load is None:
        raise ConfigError(f"the model has no load_weights and cannot be mapped ({why})")
    live = params if live is None else live
    log.info("refitflow: using the model's load_weights (%s)", why)
    return Choice("load_weights", load_weights_writer(live, load, expert_family(name for name, _ in live)), why)


def expert_family(names: Iterable[str]) -> str:
    """The checkpoint naming of experts the model's ``load_weights`` takes (``load_weights.EXPERT_NAMES``)."""
    return "block_sparse_moe" if any(".block_sparse_moe." in n for n in names) else "mlp"
