"""The state a ``NixlTransport`` keeps: its registrations, its peers, its prepared transfers."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from refitflow.transports._nixl_agent import SERVED_PREFIX, LockedAgent
from refitflow.transports._nixl_descs import RegionInfo

__all__ = ["CacheKey", "_Local", "_Peer", "_Prepared"]


@dataclass(slots=True)
class _Local:
    tensor: torch.Tensor  # keeps the memory alive while registered
    info: RegionInfo
    dlists: list[Any]  # one nixlRegDList per agent; empty for empty tensors


@dataclass(slots=True)
class _Peer:
    address: bytes
    regions: dict[int, RegionInfo]
    epoch: int
    md: bytes  # NIXL agent metadata, loaded into the agents on first read (off the event loop)
    loaded: bool = False


@dataclass(slots=True)
class _Prepared:
    larr: np.ndarray
    rarr: np.ndarray
    epoch: int  # the peer's address epoch it was prepared under
    regions: frozenset[int]  # the local regions it lands in
    nx: LockedAgent
    handles: tuple[Any, ...]  # (local dlist, remote dlist, xfer handle)
    busy: int = 0  # READs of it submitted and not yet ended (a poster thread may still check its handle)
    doomed: bool = False  # released while busy: its handles go once the last READ ended
    notif: bytes = b""  # tells the owner how many bytes this READ took from it (its ``served_bytes``)

    def __post_init__(self) -> None:
        self.notif = SERVED_PREFIX + str(int(self.larr[:, 1].sum()) if len(self.larr) else 0).encode()


CacheKey = tuple[Hashable, str, str, str, int]  # (read key, peer, local mem, remote mem, stripe)
