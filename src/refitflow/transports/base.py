"""The transport seam: register memory, describe it to peers, read byte ranges from peers.

A transport is one agent in one process. Publishers register the memory of their shards and
announce ``address()``; receivers ``connect()`` to those addresses, register their own landing
memory (destination parameters, staging arena) and issue one-sided ``read``s. Everything is bytes:
a read names a peer's region and offset and lands in a contiguous local uint8 view.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

import anyio
import torch

from refitflow.core.types import SourceAddress

__all__ = ["Read", "Submitted", "Transport", "as_bytes", "settle_or_abandon"]


@dataclass(frozen=True, slots=True)
class Read:
    """``count`` byte ranges of ``nbytes`` from one source region, ``stride`` bytes apart, landing back
    to back in one local buffer (a column slice of many rows is one strided read; transports expand it).
    A negative ``stride`` reads runs downwards from ``offset``: neighbouring tensors of a trainer buffer
    laid out in reverse (Megatron's DDP buffers) landing in order in one parameter.
    """

    peer: str
    region: int
    offset: int
    nbytes: int  # per run
    dst: torch.Tensor  # contiguous uint8 view of exactly nbytes * count, inside registered local memory
    stride: int = 0  # source bytes from one run's start to the next (count > 1; may be negative)
    count: int = 1

    @property
    def total(self) -> int:
        """Bytes landed."""
        return self.nbytes * self.count

    @property
    def low(self) -> int:
        """The lowest source offset read (the last run's start when ``stride`` is negative)."""
        return self.offset + min(0, (self.count - 1) * self.stride)

    @property
    def extent(self) -> int:
        """Source bytes spanned, from the lowest run's start to the highest run's end."""
        return (self.count - 1) * abs(self.stride) + self.nbytes if self.count else 0


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's bytes (no copy)."""
    flat = tensor.detach().reshape(-1)
    if flat.data_ptr() != tensor.data_ptr() or not tensor.is_contiguous():
        raise ValueError("tensor is not contiguous")
    return flat.view(torch.uint8)


class Submitted:
    """Reads handed to a transport (``Transport.submit``) and not yet waited for.

    This base form reads when waited for (a transport that cannot post ahead); a transport that posts at once
    subclasses it. ``wait`` returns when every byte has landed (``TransportError`` on any failure);
    ``settle`` waits for the reads to end, whatever their outcome, before their memory may be reused.
    """

    def __init__(self, transport: Transport, reads: Sequence[Read], key: Hashable | None, count: bool) -> None:
        self.transport, self.reads, self.key, self.count = transport, reads, key, count

    def landed(self) -> bool:
        """Whether every read already landed, so that ``wait`` would return at once (never, here: these read
        when waited for)."""
        return False

    async def wait(self) -> None:
        await self.transport.read(self.reads, key=self.key, count=self.count)

    async def settle(self) -> None:
        """Nothing was posted before ``wait``: nothing can still be landing."""

    def abandon(self) -> None:
        """The caller stopped waiting for reads still in progress (``settle`` ran out of time). The transport
        keeps them until they end — their bytes may land late — and ``Transport.quiesce`` waits for that.
        Nothing to do for reads that start only when waited for."""


async def settle_or_abandon(flights: Iterable[Submitted], within: float) -> None:
    """After a failure or a cancellation: wait, shielded, up to ``within`` seconds for every read of ``flights``
    to end (landed or failed); those still in progress then (a peer that stopped answering) are abandoned: the
    transport sees them to their end, and memory they land in is reused only after ``Transport.quiesce``."""
    pending = list(flights)
    with anyio.CancelScope(shield=True), anyio.move_on_after(within):
        while pending:
            await pending[0].settle()
            pending.pop(0)
    for f in pending:
        f.abandon()


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
    async def read(self, reads: Sequence[Read], *, key: Hashable | None = None, count: bool = True) -> None:
        """Perform the reads; return when every byte has landed.

        ``key`` names a list of reads that will be issued again with identical ranges (a cached
        plan's bucket); a transport may prepare it once and replay it, until ``forget`` lets go of the key's
        group (its first element, when a tuple: the plan). ``count``: the peers count these
        bytes in their ``served_bytes`` (NIXL: a READ posted with a notification, which completes only
        once the peer progresses; reads from a relay, itself busy refitting, are posted without).
        Raises ``TransportError`` on any failure.
        """

    async def submit(self, reads: Sequence[Read], *, key: Hashable | None = None, count: bool = True) -> Submitted:
        """Hand the reads over and return as soon as they are posted (a transport that can post ahead), without
        waiting for the bytes: ``await submitted.wait()`` does. Many buckets stay in flight this way, and a
        transport that posts from a thread of its own completes them in batches. By default the reads start
        when waited for."""
        return Submitted(self, reads, key, count)

    async def quiesce(self, within: float) -> None:
        """Wait until every read abandoned so far (``Submitted.abandon``, or a ``read`` cancelled) has ended: until
        then its bytes may still land where it was aimed. ``TransportError`` after ``within`` seconds. A refit
        quiesces before it writes where an abandoned read may land. By default nothing outlives its wait."""
        return None

    def reconnect(self, peers: Iterable[str]) -> None:
        """Forget the connections to ``peers`` (their addresses stay): the next read of each connects afresh. A
        refit whose reads timed out asks it of every source it read: after a network partition heals, an
        endpoint that carried no read meanwhile may be dead without a sign. By default there is nothing to
        forget."""
        return None

    def forget(self, group: Hashable) -> None:
        """Drop what was prepared for reads whose ``key`` has ``group`` as its first element (a plan the caller
        let go). By default nothing is kept."""
        return None

    @property
    def served_bytes(self) -> int | None:
        """Bytes peers have read from this agent's regions, where the transport can tell (else None)."""
        return None

    @abstractmethod
    async def aclose(self) -> None:
        """Release every registration and peer."""
