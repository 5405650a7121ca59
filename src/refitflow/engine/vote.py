"""The engine vote: the ranks of one engine commit a version together or not at all.

Every rank votes exactly once per attempt — ``(ready, began, version)`` — also on its way out of a
failure, and every rank applies the same rule to the same ballots:

- every rank ready for the same version → all commit;
- otherwise every rank that began aborts (in place: fenced; shadow: the old version serves), and a
  rank that refused at begin while a peer began is fenced too;
- nobody began → nothing changes.

A peer that does not vote before the deadline counts as not ready (and as possibly begun).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import anyio
import anyio.to_thread
import torch

__all__ = ["Ballot", "Decision", "GlooVote", "VoteChannel", "decide"]


@dataclass(frozen=True, slots=True)
class Ballot:
    ready: bool
    began: bool
    version: int  # -1 when the rank did not get as far as choosing one


class Decision(enum.StrEnum):
    COMMIT = "commit"
    ABORT = "abort"
    NOTHING = "nothing"


def decide(ballots: Sequence[Ballot | None]) -> Decision:
    """The same rule on every rank; ``None`` is a peer that never voted."""
    if all(b is not None and b.ready for b in ballots) and len({b.version for b in ballots if b}) == 1:
        return Decision.COMMIT
    if any(b is None or b.began for b in ballots):
        return Decision.ABORT
    return Decision.NOTHING


class VoteChannel(Protocol):
    rank: int
    size: int

    async def exchange(self, ballot: Ballot, timeout: float) -> list[Ballot | None]:
        """Every rank's ballot (this rank's own included); ``None`` for a peer that did not vote in time."""
        ...


class GlooVote:
    """The vote over a torch.distributed CPU (gloo) process group the host engine already has.

    After a failed or timed-out exchange the group is broken (a peer died or hung): the host must
    build a new one, as it must for any collective after a rank failure.
    """

    def __init__(self, group: Any = None) -> None:
        import torch.distributed as dist

        self._dist = dist
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)

    async def exchange(self, ballot: Ballot, timeout: float) -> list[Ballot | None]:
        mine = torch.tensor([int(ballot.ready), int(ballot.began), ballot.version], dtype=torch.int64)
        gathered = [torch.empty_like(mine) for _ in range(self.size)]

        def gather() -> None:
            self._dist.all_gather(gathered, mine, group=self.group)

        with anyio.move_on_after(timeout):
            try:
                await anyio.to_thread.run_sync(gather, abandon_on_cancel=True)
            except RuntimeError:  # a peer died: gloo's connection closed
                pass
            else:
                return [Ballot(bool(t[0]), bool(t[1]), int(t[2])) for t in gathered]
        return [ballot if i == self.rank else None for i in range(self.size)]
