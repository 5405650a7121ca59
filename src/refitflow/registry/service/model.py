"""What the registry holds of one identity: its versions, by rank, and their state.

A version is *laid out* once every rank of its publisher's world announced it (digests possibly pending:
two-phase publication), *complete* once every rank's digests are in too.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from refitflow.core.types import Identity, Manifest, Publication
from refitflow.registry.service.checks import VersionIndex
from refitflow.registry.service.fanout import Relays

__all__ = ["Model", "mark", "newest", "unmark"]


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


def newest(
    models: Mapping[Identity, Model], identity: Identity, min_version: int, targets: Collection[str] | None,
    metadata: Mapping[str, str] | None, early: bool = False, skip: Collection[int] = (),
) -> Publication | None:  # fmt: skip
    """The newest complete (``early``: or laid-out) version ≥ ``min_version`` among ``models`` (the
    ``Discovery.latest`` filters: compile ``targets``, ``metadata``, versions to ``skip``), or None."""
    best: Publication | None = None
    names = [identity.compile_target] if targets is None else list(dict.fromkeys(targets))
    for target in names:
        model = models.get(dataclasses.replace(identity, compile_target=target))
        if model is None:
            continue
        for version in reversed(model.laid_out if early else model.complete):
            if version < min_version or (best is not None and version <= best.version):
                break
            if version in skip:
                continue
            ranks = model.versions[version]
            manifests = tuple(ranks[r] for r in range(len(ranks)))
            if metadata and not all(metadata.items() <= m.metadata.items() for m in manifests):
                continue
            best = Publication(identity=manifests[0].identity, version=version, manifests=manifests)
            break
    return best
