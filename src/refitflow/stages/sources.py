"""Source selection: which of the sources holding a whole tensor a rank reads it from.

Trainer ranks and replica sources (receivers serving a version they committed) can hold the same
whole tensor. A rank spreads its reads by load: each tensor goes to the candidate with the least
cost after taking it, where cost is the bytes this plan already reads from that source, and a
trainer's bytes count ``TRAINER_COST`` times. So with no replica a rank reads from the trainer
ranks evenly, and with replicas it leaves the trainer roughly 1/(1 + TRAINER_COST·R) of its bytes:
the trainer's egress stays about one model copy however many receivers refit, in waves.
"""

from __future__ import annotations

from collections.abc import Sequence

from refitflow.core.types import ShardSpec

__all__ = ["TRAINER_COST", "SourceLoad"]

TRAINER_COST = 4.0


class SourceLoad:
    """The bytes one plan reads from each source; ``trainers``: sources ``0..trainers-1`` are trainer ranks."""

    def __init__(self, trainers: int) -> None:
        self.trainers = trainers
        self.bytes: dict[int, int] = {}

    def choose(self, candidates: Sequence[tuple[int, ShardSpec]]) -> tuple[int, ShardSpec]:
        """The least loaded candidate after taking this tensor (ties: the lowest source index)."""
        got, trainers = self.bytes.get, self.trainers
        best, least, size = candidates[0], (float("inf"), 0), 0
        for c in candidates:  # (a plain loop: a layer norm of a TP 8 x EP 32 trainer has 32 candidates)
            n = c[1].nbytes
            cost = ((got(c[0], 0) + n) * (TRAINER_COST if c[0] < trainers else 1.0), c[0])
            if cost < least:
                best, least, size = c, cost, n
        self.bytes[best[0]] = got(best[0], 0) + size
        return best
