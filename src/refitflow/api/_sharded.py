"""``rf.Sharded``: the part of a tensor one trainer rank publishes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Sharded"]


@dataclass(frozen=True, kw_only=True)
class Sharded:
    """The part of a tensor this rank holds: ``tensor`` is ``global[start:stop]`` along ``axis``."""

    tensor: torch.Tensor
    axis: int
    start: int
    global_shape: tuple[int, ...]
