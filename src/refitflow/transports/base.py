"""The transport seam: register memory, describe it to peers, read byte ranges from peers.

A transport is one agent in one process. Publishers register the memory of their shards and
announce ``address()``; receivers ``connect()`` to those addresses, register their own landing
memory (destination parameters, staging arena) and issue one-sided ``read``s. Everything is bytes:
a read names a peer's region and offset and lands in a contiguous local uint8 view.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from refitflow.core.types import SourceAddress

__all__ = ["Read", "Transport", "as_bytes"]


@dataclass(frozen=True, slots=True)
class Read:
    """One contiguous byte range from one source region into one local buffer."""

    peer: str
    region: int
    offset: int
    nbytes: int
    dst: torch.Tensor  # contiguous uint8 view of exactly nbytes, inside registered local memory


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's bytes (no copy)."""
    flat = tensor.detach().reshape(-1)
    if flat.data_ptr() != tensor.data_ptr() or not tensor.is_contiguous():
        raise ValueError("tensor is not contiguous")
    return flat.view(torch.uint8)


class Transport(ABC):
    """One agent of one transport in this process."""

    name: str = "abstract"

    @property
    @abstractmethod
    def agent(self) -> str:
        """This agent's unique name."""

    @abstractmethod
    def register(self, tensor: torch.Tensor) -> int:
        """Register a contiguous tensor's memory; return its region id. Idempotent per storage."""

    @abstractmethod
    def deregister(self, region: int) -> None:
        """Forget a region; later reads of it fail with ``TransportError``."""

    @abstractmethod
    def address(self) -> SourceAddress:
        """How peers reach this agent's registered memory (a fresh snapshot)."""

    @abstractmethod
    def connect(self, source: SourceAddress) -> None:
        """Learn (or refresh) a peer from its address. Idempotent."""

    @abstractmethod
    async def read(self, reads: Sequence[Read], *, key: Hashable | None = None) -> None:
        """Perform the reads; return when every byte has landed.

        ``key`` names a list of reads that will be issued again with identical ranges (a cached
        plan's bucket); a transport may prepare it once and replay it.
        Raises ``TransportError`` on any failure.
        """

    @property
    def served_bytes(self) -> int | None:
        """Bytes peers have read from this agent's regions, where the transport can tell (else None)."""
        return None

    @abstractmethod
    async def aclose(self) -> None:
        """Release every registration and peer."""
