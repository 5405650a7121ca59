"""Parts of a publication a receiver reads: registered once per plan, served per version without re-encoding.

A receiver's plan reads the shards of a few trainer ranks, and of those only some digests (whole-row reads
need a shard's row digests, a column slice its column tiles). It registers that *part* once — per rank, the
layout it was planned on, and runs ``(rank, first, count)`` of digest indices in the rank's digest vector, in the
order it wants them — and gets its id (BLAKE2b-128 of the part: receivers of one plan in every engine register
the same part). Per version it then fetches the part by id: the digests at those indices, raw, in that order.

The registry gathers a part once per version (numpy, from each rank's digest vector) and serves those bytes to
every receiver that asks for it (``Parts``: an LRU of the gathered bytes). A part names the layouts it was
planned on: a version of other layouts is refused (the receiver plans again), never read at the wrong places.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from refitflow.core.errors import ManifestError, VersionError
from refitflow.core.records import Announcement
from refitflow.core.wire import UNKNOWN_LAYOUT

__all__ = ["MAX_PART_DIGESTS", "Part", "Parts"]

MAX_PART_DIGESTS = 1 << 28  # digests one part may name (2 GiB of them)
_PARTS = 1024  # parts held (a plan's each; receivers of one plan share one)
_GATHERED = 64  # parts gathered, kept for the next receiver asking for the same version


@dataclass(frozen=True, eq=False)
class Part:
    id: str
    layouts: dict[int, str]  # rank -> the layout id the part was planned on
    take: tuple[tuple[int, np.ndarray, np.ndarray], ...]  # per rank: (rank, indices in its vector, places in the part)
    count: int


def _part(layouts: dict[int, str], runs: np.ndarray, most: int) -> Part:
    h = hashlib.blake2b(digest_size=16)
    for rank in sorted(layouts):
        h.update(f"{rank}:{layouts[rank]};".encode())
    h.update(runs.tobytes())
    ranks, firsts, counts = runs[:, 0], runs[:, 1], runs[:, 2]
    total = int(counts.sum())
    if total > min(most, MAX_PART_DIGESTS):
        raise ManifestError(f"a part of {total} digests, more than the {most} its ranks hold")
    ends = np.cumsum(counts)
    starts = ends - counts
    run_of = np.repeat(np.arange(len(runs)), counts)
    index = firsts[run_of] + (np.arange(total) - starts[run_of])  # every digest the part names, in part order
    rank_of = ranks[run_of]
    take = []
    for rank in np.unique(ranks).tolist():
        places = np.flatnonzero(rank_of == rank)
        take.append((int(rank), index[places], places))
    return Part(h.hexdigest(), layouts, tuple(take), total)


class Parts:
    """The parts registered here and the bytes gathered for the latest asks."""

    def __init__(self) -> None:
        self._parts: OrderedDict[str, Part] = OrderedDict()
        self._gathered: OrderedDict[tuple[str, int, tuple[str, ...]], bytes] = OrderedDict()

    def register(self, layouts: Sequence[object], runs: memoryview | bytes, entries: Sequence[Announcement]) -> Part:
        """A part (``layouts``: ``[rank, layout id]`` pairs; ``runs``: int64 triples ``rank, first, count``, little-
        endian) checked against the version's ranks ``entries``: each rank named once, of the layout named, each
        run inside its rank's digest vector."""
        if len(runs) % 24:
            raise ManifestError("a part's runs are int64 triples (rank, first, count)")
        table = np.frombuffer(runs, dtype="<i8").reshape(-1, 3).astype(np.int64)
        if not isinstance(layouts, list) or not all(
                isinstance(p, list) and len(p) == 2 and type(p[0]) is int and type(p[1]) is str for p in layouts):
            raise ManifestError("a part's layouts are [rank, layout id] pairs")  # fmt: skip
        named = {int(r): str(i) for r, i in layouts}
        world = len(entries)
        if len(named) != len(layouts) or not all(0 <= r < world for r in named):
            raise ManifestError(f"a part names each rank of the {world} once")
        for rank, lid in named.items():
            if entries[rank].layout.id != lid:
                raise VersionError(f"rank {rank}'s layout is not the one the part was planned on: plan again",
                                   version=entries[rank].version)  # fmt: skip
        if len(table) and (table[:, 1].min() < 0 or table[:, 2].min() < 1):
            raise ManifestError("a part's runs start at an index ≥ 0 and hold at least one digest")
        for rank in np.unique(table[:, 0]).tolist() if len(table) else ():
            if rank not in named:
                raise ManifestError(f"a part's run names rank {rank}, which its layouts do not")
            mine = table[table[:, 0] == rank]
            if int((mine[:, 1] + mine[:, 2]).max()) > entries[rank].layout.count:
                raise ManifestError(f"a part's run lies beyond rank {rank}'s {entries[rank].layout.count} digests")
        part = _part(named, table, sum(entries[r].layout.count for r in named))
        self._parts[part.id] = part
        self._parts.move_to_end(part.id)
        while len(self._parts) > _PARTS:
            self._parts.popitem(last=False)
        return part

    def get(self, part_id: str) -> Part:
        part = self._parts.get(part_id)
        if part is None:
            raise ManifestError(f"{UNKNOWN_LAYOUT} (a part {part_id:.12}): send the part itself")
        self._parts.move_to_end(part_id)
        return part

    def gather(self, part: Part, entries: Sequence[Announcement]) -> bytes:
        """The digests ``part`` names at the version of ``entries`` (gathered once per version)."""
        for rank, lid in part.layouts.items():
            if rank >= len(entries) or entries[rank].layout.id != lid:
                raise VersionError(f"rank {rank}'s layout is not the one the part was planned on: plan again",
                                   version=entries[0].version)  # fmt: skip
        key = (part.id, entries[0].version, tuple(entries[r].revision for r in sorted(part.layouts)))
        hit = self._gathered.get(key)
        if hit is None:
            out = np.empty(part.count, dtype=np.uint64)  # 8-byte words moved as they are (big-endian digests)
            for rank, index, places in part.take:
                raw = entries[rank].raw
                if raw is None:
                    raise VersionError(f"rank {rank}'s digests are pending", version=entries[rank].version)
                out[places] = np.frombuffer(raw, dtype=np.uint64)[index]
            hit = self._gathered[key] = out.tobytes()
            while len(self._gathered) > _GATHERED:
                self._gathered.popitem(last=False)
        self._gathered.move_to_end(key)
        return hit
