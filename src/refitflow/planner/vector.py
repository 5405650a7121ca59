"""A version's digest vector for a plan: the digests of the shards it reads, in the order its checks index them.

A whole publication's manifests each hold their digests decoded once, as they were made
(``Manifest.digest_blob``: 8 bytes a digest, big-endian, shard after shard). A plan knows where in those blobs
the digests it reads lie (``DigestRuns``, from its layout, made with the plan), so a version's vector is a gather
— for 10,000 whole-tensor digests ≈ 0.05 ms where decoding them shard by shard took ≈ 2 ms before the first
read. Whether the shards are where the plan's layout put them is checked on its own (``check_placed``, beside
the first reads: nothing is compared before it passed); the runs themselves are checked against each blob's
length. Where the digests of shards the plan does not read lie (their counts, before a shard it reads) is taken
from the layout the plan was built for: a publisher that keeps its layout digest while changing those in ways that
keep the blob's length gets an ``IntegrityError`` (nothing commits) where ``ManifestError`` would be exact. A
registry across the network answers with the plan's part instead (``refit.digests``).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from refitflow.core.errors import ManifestError
from refitflow.core.threads import let_go
from refitflow.core.types import TILING_FIELDS, Publication, digests_of

__all__ = ["NOT_PLACED", "PLACE", "DigestRuns", "check_placed", "digest_vector", "every_shard"]

PLACE = operator.attrgetter("name", *TILING_FIELDS)  # a shard's name and its digest geometry (TILING_KEY after it)
NOT_PLACED = "the publication's shards are not where, or not what, its layout digest says"
UNFIT = "the publication's digests do not fit its layout digest"
_CHUNK = 1024  # shards compared between two chances for other threads to take the GIL (``_placed``)
Order = Sequence[tuple[int, int, tuple[Any, ...]]]  # a plan's shards: (source, position, PLACE), in vector order


@dataclass(frozen=True, eq=False)
class DigestRuns:
    """Where a plan's digests lie in the digest blobs of the manifests it reads: per source read, its blob's
    digests in all, and per shard read where its digests start in the blob and in the vector, and how many."""

    sources: tuple[int, ...]
    totals: tuple[int, ...]  # digests in each source's blob
    runs: tuple[tuple[np.ndarray, np.ndarray, np.ndarray], ...]  # per source: (blob starts, vector starts, counts)
    count: int  # digests in the vector

    @classmethod
    def of(cls, offsets: dict[int, np.ndarray], order: Order, at: Sequence[int], counts: Sequence[int]) -> DigestRuns:
        """From each source's shard offsets in its blob (``offsets[s][p]``: where shard ``p``'s digests start; one
        entry more: the blob's end) and, per shard of ``order``, its place (``at``) and digests in the vector."""
        by: dict[int, list[tuple[int, int, int]]] = {s: [] for s in offsets}
        for (s, p, _), v, n in zip(order, at, counts, strict=True):
            by[s].append((int(offsets[s][p]), v, n))
        runs = tuple(tuple(np.array(col, dtype=np.int64) for col in zip(*by[s], strict=True)) for s in offsets)
        return cls(tuple(offsets), tuple(int(o[-1]) for o in offsets.values()), runs, sum(counts))  # type: ignore[arg-type]

    def vector(self, pub: Publication) -> np.ndarray:
        """``pub``'s digests at these runs, native uint64 (``ManifestError``: a blob of another length, a source
        it lacks, digests pending)."""
        out = np.empty(self.count, dtype=np.uint64)
        mans = pub.manifests
        for s, total, (src, dst, n) in zip(self.sources, self.totals, self.runs, strict=True):
            if s >= len(mans):
                raise ManifestError(NOT_PLACED, version=pub.version)
            blob = np.frombuffer(mans[s].digest_blob, dtype=">u8")
            if len(blob) != total:
                raise ManifestError(UNFIT, version=pub.version)
            if len(n) and int(n.max()) == 1:  # one digest a shard (whole tensors): a plain gather
                out[dst] = blob[src]
            else:
                out[_spread(dst, n)] = blob[_spread(src, n)]
        return out


def _spread(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Every index of the runs ``[start, start + count)``, run after run."""
    ends = np.cumsum(counts)
    return np.repeat(starts - ends + counts, counts) + np.arange(int(ends[-1]) if len(ends) else 0)


def every_shard(pub: Publication) -> tuple[list[tuple[int, int, tuple[Any, ...]]], int]:
    """The ``order`` and ``count`` of a plan that read every shard of ``pub`` (benches: every shard's digests)."""
    order = [(s, p, PLACE(spec)) for s, m in enumerate(pub.manifests) for p, spec in enumerate(m.shards)]
    return order, sum(spec.tiling.count for m in pub.manifests for spec in m.shards)


def digest_vector(pub: Publication, order: Order, count: int, *, placed: bool = True,
                  runs: DigestRuns | None = None) -> np.ndarray:  # fmt: skip
    """The digests of the shards in ``order`` (``DigestIndex.order``: a plan's), ``count`` of them, as native
    uint64, once per version: gathered at ``runs`` (the plan's), else decoded shard by shard. A publication whose
    shards are not where its layout put them when the plan was built, or not of the same digest geometry, is
    refused (``ManifestError``): a publisher's layout digest (the plan cache's key) is its word, not a proof.
    ``placed=False`` leaves that check to ``check_placed`` (a refit runs it beside its first reads: nothing is
    compared or committed before it passed)."""
    if placed:
        check_placed(pub, order)
    if runs is not None:
        return runs.vector(pub)
    specs = _specs(pub, order)
    if specs is None:
        raise ManifestError(NOT_PLACED, version=pub.version)
    raw = digests_of(specs)
    if len(raw) != 8 * count:
        raise ManifestError(UNFIT, version=pub.version)
    return np.frombuffer(raw, dtype=">u8").astype(np.uint64)


def check_placed(pub: Publication, order: Order) -> None:
    """Whether the shards at the plan's positions are the ones it was built for (``ManifestError``)."""
    specs = _specs(pub, order)
    if specs is None or not _placed(specs, order):
        raise ManifestError(NOT_PLACED, version=pub.version)


def _specs(pub: Publication, order: Order) -> list[Any] | None:
    """The shards at the plan's positions (None: a position past a manifest's end)."""
    mans = pub.manifests
    try:
        return [mans[s].shards[p] for s, p, _ in order]
    except IndexError:
        return None


def _placed(specs: list[Any], order: Order) -> bool:
    """Compared 1,024 shards at a time, the GIL let go between (``let_go``): one comparison of 10,000 is ≈ 2 ms in
    C calls that keep it, and it runs beside the first reads — their poster thread waited for it."""
    for i in range(0, len(specs), _CHUNK):
        if list(map(PLACE, specs[i : i + _CHUNK])) != [place for _, _, place in order[i : i + _CHUNK]]:
            return False
        let_go()
    return True
