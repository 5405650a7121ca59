"""A rank's plans, cached with what its refits make of them (``Replay``), so a replayed refit builds nothing.

Plans are kept by (publication layout, receiver layout, limits), a few at a time, least recently used dropped
(and told to ``on_drop``: a receiver's transport lets go of what it prepared for the plan's reads, whose keys
start with the plan's serial); the receiver layout is built once per destination (``receiver``: a receiver
builds it as it starts). With each
plan lives its ``Replay``: the transport reads of each bucket, the copies translate hands apply, verify's
views of where units landed. Staging placement is deterministic (``arena``) and shadow targets alternate
between two storages, so a ``slot`` — (bucket, lease offset, destination generation parity) — names the very
same objects refit after refit, and a transport recognises a read list it has prepared.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import torch

from refitflow.core.threads import built, off_loop
from refitflow.core.types import Publication
from refitflow.planner.build import build_plan
from refitflow.planner.limits import Limits
from refitflow.planner.receiver_layout import ReceiverLayout
from refitflow.planner.records import Plan
from refitflow.refit.arena import Lease
from refitflow.refit.destination import Destination
from refitflow.transports.base import Read

__all__ = ["Pair", "PlanCache", "Replay", "Slot", "slot"]

Pair = tuple[torch.Tensor, torch.Tensor]  # (destination view, staged view): one copy apply makes
Slot = tuple[int, int, int]  # (bucket index, lease offset or -1, destination generation % 2)


def slot(bucket: int, lease: Lease | None, dest: Destination) -> Slot:
    """Where a bucket's bytes land this time: the same slot means the very same views and reads as last time."""
    return bucket, -1 if lease is None else lease.offset, dest.generation % 2


@dataclass(eq=False)
class Replay:
    """What refits made of one plan, for the refits that replay it (each by ``Slot``)."""

    reads: dict[Slot, list[Read]] = field(default_factory=dict)  # every piece's reads (pull)
    # the last subset of a bucket's pieces read (a frozen part repeats refit after refit): (pieces, its reads)
    some: dict[Slot, tuple[bytes, list[Read]]] = field(default_factory=dict)
    copies: dict[Slot, list[Pair]] = field(default_factory=dict)  # every staged piece's copies (translate)
    piece_copies: dict[Slot, dict[int, list[Pair]]] = field(default_factory=dict)  # the same, per piece
    # whole units' and streams' bytes in host memory (verify)
    views: dict[Slot, tuple[list[memoryview], list[memoryview]] | None] = field(default_factory=dict)
    # relayed pieces' reads, by slot and pieces, for the relay ``relay`` names (agent, address, regions, layout)
    relayed: dict[tuple[Slot, tuple[int, ...]], list[Read]] = field(default_factory=dict)
    relay: Any = None
    relay_upstream: Any = None  # the attempt's upstream ``relay`` was last checked for (once an attempt)


class PlanCache:
    """Plans by (publication layout, receiver layout, limits), each with its ``Replay``; ``size`` kept."""

    def __init__(self, size: int = 4, on_drop: Callable[[Plan], None] | None = None) -> None:
        self._plans: OrderedDict[Hashable, tuple[Plan, Replay]] = OrderedDict()
        self._size = size
        self.on_drop = on_drop
        self.hits = 0
        self.misses = 0
        self._receiver: ReceiverLayout | None = None

    def receiver(self, dest: Destination) -> ReceiverLayout:
        """What plans need of ``dest`` (built once: a receiver calls this in a worker thread as it starts)."""
        if self._receiver is None or self._receiver.dest is not dest:
            self._receiver = built(ReceiverLayout, dest)
        return self._receiver

    def key(self, pub: Publication, dest: Destination, limits: Limits) -> Hashable:
        return (pub.layout_key(), self.receiver(dest).key, limits)

    def plans(self) -> list[Plan]:
        """The plans kept, least recently used first."""
        return [plan for plan, _ in self._plans.values()]

    def lookup(self, key: Hashable) -> tuple[Plan, Replay] | None:
        found = self._plans.get(key)
        if found is not None:
            self.hits += 1
            self._plans.move_to_end(key)
        return found

    def store(self, plan: Plan) -> tuple[Plan, Replay]:
        self.misses += 1
        entry = self._plans[plan.key] = (plan, Replay())
        if len(self._plans) > self._size:
            self._dropped(self._plans.popitem(last=False)[1][0])
        return entry

    def clear(self) -> None:
        """Drop every plan (the destination changed: ``Receiver.rebind``)."""
        while self._plans:
            self._dropped(self._plans.popitem(last=False)[1][0])
        self._receiver = None

    def _dropped(self, plan: Plan) -> None:
        if self.on_drop is not None:
            self.on_drop(plan)

    async def get(self, pub: Publication, dest: Destination, limits: Limits) -> tuple[Plan, Replay]:
        """The cached plan, or a new one built in a worker thread (a big model's plan takes tens of ms)."""
        if self._receiver is None or self._receiver.dest is not dest:  # once per destination: off the loop
            await off_loop(self.receiver, dest)
        key = self.key(pub, dest, limits)
        found = self.lookup(key)
        if found is None:
            receiver = self.receiver(dest)
            found = self.store(await off_loop(build_plan, pub, receiver, limits, key))
        return found
