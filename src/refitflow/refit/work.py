"""``Work``: one bucket on its way through allocate → pull → translate → apply → verify → commit.

Each stage fills in what it made of the bucket for the stages after it, and nothing else: allocate its
staging lease, pull which pieces came from a relay and the bytes read, translate the copies, apply their
device marks, verify what it verified. Commit adds the counts up (``attempt.Tally``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from refitflow.planner.records import Bucket
from refitflow.refit.arena import Lease
from refitflow.refit.device import Marks
from refitflow.refit.handoff import Receiving, Sending
from refitflow.refit.plans import Pair

__all__ = ["Receive", "Send", "Work"]


@dataclass(eq=False, slots=True)
class Work:
    bucket: Bucket
    actions: np.ndarray | None = None  # delta refits: per piece PULL, HELD or COPY (planner.delta); None: pull all
    recheck: np.ndarray | None = None  # per piece: a skipped piece re-hashed where it lies
    lease: Lease | None = None  # allocate: its staging bytes (None: nothing staged)
    relayed: list[int] = field(default_factory=list)  # pull: pieces read from the upstream relay
    pulled: int = 0  # pull (and verify's second reads): bytes read from a source
    relay_bytes: int = 0  # of ``pulled``, from the upstream relay
    rerouted: int = 0  # of ``pulled``, from the trainer after the relay failed it
    repaired: int = 0  # verify: skipped pieces that differed where they lay, read again
    copies: list[Pair] = field(default_factory=list)  # translate: (destination view, staged view) pairs
    marks: Marks = ()  # apply: the bucket's device work so far (DeviceLane.record); empty on CPU
    unverified: int = 0  # verify: pulled bytes of this bucket no whole digest unit covered, so far
    verified_through: int = -1  # verify: every unit of the buckets up to this index is verified (relay progress)


Receive = Receiving[Work]  # a stage's input
Send = Sending[Work]  # a stage's output
