"""Cross-rank checks of a manifest against the other ranks of its version, on arrival."""

from __future__ import annotations

import string
from collections.abc import Iterable

from refitflow.core.errors import ManifestError
from refitflow.core.types import Manifest, ShardSpec

__all__ = ["check_against"]

_HEX = frozenset(string.hexdigits)


def check_against(manifest: Manifest, others: Iterable[Manifest]) -> None:
    """Refuse ``manifest`` when it disagrees with the other ranks of its version.

    Shards of one tensor across ranks must agree on global shape, dtype and axis, and sharded ones
    must not overlap; every digest must be hex. ``ShardSpec`` already checked each shard alone.
    """
    version = manifest.version
    for s in manifest.shards:
        if not _HEX.issuperset(s.digest):
            raise ManifestError("digest is not hexadecimal", version=version, tensor=s.name)
    mine = {s.name: s for s in manifest.shards}
    for other in others:
        if other.rank == manifest.rank:
            continue
        if other.world_size != manifest.world_size:
            raise ManifestError(
                f"world size {manifest.world_size} disagrees with {other.world_size} of rank {other.rank}",
                version=version,
            )
        for theirs in other.shards:
            ours = mine.get(theirs.name)
            if ours is not None:
                _agree(ours, theirs, other.rank, version)


def _agree(s: ShardSpec, theirs: ShardSpec, rank: int, version: int) -> None:
    for field in ("global_shape", "dtype"):
        if getattr(s, field) != getattr(theirs, field):
            raise ManifestError(
                f"{field} {getattr(s, field)!r} disagrees with {getattr(theirs, field)!r} of rank {rank}",
                version=version,
                tensor=s.name,
            )
    if s.axis != theirs.axis:
        raise ManifestError(f"shard axis {s.axis} disagrees with {theirs.axis} of rank {rank}", version=version,
                            tensor=s.name)  # fmt: skip
    if s.axis is not None and s.start < theirs.stop and theirs.start < s.stop:
        raise ManifestError(
            f"shard [{s.start}, {s.stop}) overlaps [{theirs.start}, {theirs.stop}) of rank {rank}",
            version=version,
            tensor=s.name,
        )
