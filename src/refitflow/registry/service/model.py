"""What the registry holds of one identity: its versions, by rank, and their state.

A version is *laid out* once every rank of its publisher's world announced it (digests possibly pending:
two-phase publication), *complete* once every rank's digests are in too.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from refitflow.core.types import Manifest
from refitflow.registry.service.checks import VersionIndex
from refitflow.registry.service.fanout import Relays

__all__ = ["Model", "mark", "unmark"]


@dataclass
class Model:
    versions: dict[int, dict[int, Manifest]] = field(default_factory=dict)  # version -> rank -> manifest
    order: list[int] = field(default_factory=list)  # the versions held, ascending
    complete: list[int] = field(default_factory=list)  # the complete ones (every rank, every digest), ascending
    laid_out: list[int] = field(default_factory=list)  # every rank announced, some still pending, ascending
    index: dict[int, VersionIndex] = field(default_factory=dict)  # version -> its tensors so far
    owner: dict[tuple[int, int], str] = field(default_factory=dict)  # (version, rank) -> owner, if any
    first_seen: dict[int, float] = field(default_factory=dict)  # version -> clock at its first manifest
    receivers: dict[str, int] = field(default_factory=dict)  # receiver id -> highest version done with
    completed_at: dict[int, float] = field(default_factory=dict)  # version -> clock when first complete
    relays: dict[int, Relays] = field(default_factory=dict)  # version -> its relays (pipelined fan-out)

    @property
    def newest(self) -> int | None:
        return self.complete[-1] if self.complete else None

    def drop(self, version: int) -> None:
        for rank in self.versions.pop(version, {}):
            self.owner.pop((version, rank), None)
        self.index.pop(version, None)
        self.first_seen.pop(version, None)
        self.completed_at.pop(version, None)
        self.relays.pop(version, None)
        for ordered in (self.order, self.complete, self.laid_out):
            unmark(ordered, version)

    def drop_rank(self, version: int, rank: int) -> None:
        """A rank's manifest goes (its owner's lease ran out): the version is incomplete again, or gone."""
        ranks = self.versions[version]
        del ranks[rank]
        self.owner.pop((version, rank), None)
        if not ranks:
            self.drop(version)
            return
        self.index[version] = VersionIndex(list(ranks.values()))
        self.completed_at.pop(version, None)
        self.relays.pop(version, None)
        unmark(self.complete, version)
        unmark(self.laid_out, version)


def mark(ordered: list[int], version: int) -> None:
    at = bisect.bisect_left(ordered, version)
    if at == len(ordered) or ordered[at] != version:
        ordered.insert(at, version)


def unmark(ordered: list[int], version: int) -> None:
    at = bisect.bisect_left(ordered, version)
    if at < len(ordered) and ordered[at] == version:
        del ordered[at]
