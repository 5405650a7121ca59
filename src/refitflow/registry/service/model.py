"""What the registry holds of one identity: its versions, by rank, and their state.

A version is *laid out* once every rank of its publisher's world announced it (digests possibly pending:
two-phase publication), *complete* once every rank's digests are in too. Each rank's announcement is an
``Announcement``: its layout, shared by every version of that layout, and the version's record.

Cross-rank checks (``checks.VersionIndex``: shapes, dtypes and axes agree, ranges do not overlap) depend on the
ranks' layouts alone, so they are made once per combination of layouts: a laid-out version whose ranks were
checked leaves its ranks' layouts as a *known-good* combination (``good``, the last few), and a later version
whose ranks all announce layouts of one known-good combination is not checked again — O(1) per rank.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from refitflow.core.records import Announcement, RankLayout
from refitflow.core.types import Identity
from refitflow.registry.service.checks import VersionIndex
from refitflow.registry.service.fanout import Relays

__all__ = ["Found", "Model", "mark", "newest", "unmark"]

GOOD = 4  # known-good combinations of layouts kept per identity

Found = tuple[Identity, int, tuple[Announcement, ...]]  # a version found: identity, number, ranks in rank order


@dataclass
class Model:
    versions: dict[int, dict[int, Announcement]] = field(default_factory=dict)  # version -> rank -> entry
    order: list[int] = field(default_factory=list)  # the versions held, ascending
    complete: list[int] = field(default_factory=list)  # the complete ones (every rank, every digest), ascending
    laid_out: list[int] = field(default_factory=list)  # every rank announced, some still pending, ascending
    index: dict[int, VersionIndex] = field(default_factory=dict)  # version -> its tensors so far (made on need)
    good: list[dict[int, str]] = field(default_factory=list)  # combinations of layouts checked: rank -> layout id
    fits: dict[int, list[dict[int, str]]] = field(default_factory=dict)  # version -> the good ones its ranks fit
    owner: dict[tuple[int, int], str] = field(default_factory=dict)  # (version, rank) -> owner, if any
    first_seen: dict[int, float] = field(default_factory=dict)  # version -> clock at its first manifest
    receivers: dict[str, int] = field(default_factory=dict)  # receiver id -> highest version done with
    completed_at: dict[int, float] = field(default_factory=dict)  # version -> clock when first complete
    relays: dict[int, Relays] = field(default_factory=dict)  # version -> its relays (pipelined fan-out)
    upstream: dict[str, str] = field(default_factory=dict)  # receiver id -> the relay it read its last version from

    @property
    def newest(self) -> int | None:
        return self.complete[-1] if self.complete else None

    def check_rank(self, version: int, layout: RankLayout) -> None:
        """Refuse ``layout`` for a new rank of ``version`` when it disagrees with the ranks held; nothing to do
        when they and it belong to one known-good combination."""
        known = self.versions.get(version, {})
        if any(good.get(layout.rank) == layout.id for good in self._fitting(version, known)):
            return
        index = self.index.get(version)
        if index is None:
            index = self.index[version] = VersionIndex([e.layout.manifest for e in known.values()])
        index.check(layout.manifest, version)

    def _fitting(self, version: int, known: dict[int, Announcement]) -> list[dict[int, str]]:
        """The known-good combinations the ranks ``known`` of ``version`` all belong to."""
        fits = self.fits.get(version)
        if fits is None:
            fits = self.fits[version] = [g for g in self.good if all(g.get(r) == e.layout.id for r, e in known.items())]
        return fits

    def add_rank(self, version: int, entry: Announcement) -> None:
        """``entry`` is a new rank of ``version`` (checked); a version laid out leaves its combination as good."""
        ranks = self.versions[version]
        self.fits[version] = [g for g in self._fitting(version, ranks) if g.get(entry.rank) == entry.layout.id]
        index = self.index.get(version)
        if index is not None:
            index.add(entry.layout.manifest)
        if len(ranks) == entry.world_size and index is not None:  # checked rank by rank: its layouts agree
            combination = {r: e.layout.id for r, e in ranks.items()}
            if combination not in self.good:
                self.good = [*self.good[-(GOOD - 1) :], combination]
            del self.index[version]

    def drop(self, version: int) -> None:
        for rank in self.versions.pop(version, {}):
            self.owner.pop((version, rank), None)
        self.index.pop(version, None)
        self.fits.pop(version, None)
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
        self.index.pop(version, None)  # made again from the ranks left, if a rank needs checking
        self.fits.pop(version, None)
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


def newest(
    models: Mapping[Identity, Model], identity: Identity, min_version: int, targets: Collection[str] | None,
    metadata: Mapping[str, str] | None, early: bool = False, skip: Collection[int] = (),
) -> Found | None:  # fmt: skip
    """The newest complete (``early``: or laid-out) version ≥ ``min_version`` among ``models`` (the
    ``Discovery.latest`` filters: compile ``targets``, ``metadata``, versions to ``skip``), or None."""
    best: Found | None = None
    names = [identity.compile_target] if targets is None else list(dict.fromkeys(targets))
    for target in names:
        model = models.get(dataclasses.replace(identity, compile_target=target))
        if model is None:
            continue
        for version in reversed(model.laid_out if early else model.complete):
            if version < min_version or (best is not None and version <= best[1]):
                break
            if version in skip:
                continue
            ranks = model.versions[version]
            entries = tuple(ranks[r] for r in range(len(ranks)))
            if metadata and not all(metadata.items() <= e.metadata.items() for e in entries):
                continue
            best = (entries[0].identity, version, entries)
            break
    return best
