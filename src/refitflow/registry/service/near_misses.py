"""Near misses: what a registry holds that a discovery did not match, in sentences for its timeout message.

A receiver that waited in vain wants to know *why*: its identity differs from the publisher's in one
field, a rank has not published yet ("1 of 2 ranks published version 3"), or the newest complete
version is older than the one it asked for. Only the same model name is described (other models
are listed by name, for typos).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from refitflow.core.types import Identity

__all__ = ["near_misses"]

_FIELDS = ("layout", "dtype", "parallelism", "compile_target")
_PER_IDENTITY = 3  # versions described per identity, newest first
_MODELS = 10  # other model names listed


class _Rank(Protocol):
    @property
    def world_size(self) -> int: ...


def near_misses(
    held: Mapping[Identity, Mapping[int, Mapping[int, _Rank]]], identity: Identity, min_version: int
) -> list[str]:
    """Sentences on what ``held`` (identity -> version -> rank -> what it announced) has for ``identity.model``."""
    same = sorted(
        ((i, v) for i, v in held.items() if i.model == identity.model and v),
        key=lambda item: (item[0] != identity, item[0].key()),
    )
    if not same:
        others = sorted({i.model for i, v in held.items() if v})[:_MODELS]
        listed = f" (models held: {', '.join(repr(m) for m in others)})" if others else " (it holds nothing)"
        return [f"nothing published for model {identity.model!r}{listed}"]
    out = []
    for other, versions in same:
        diff = [f"{f}={getattr(other, f)!r} (not {getattr(identity, f)!r})" for f in _FIELDS
                if getattr(other, f) != getattr(identity, f)]  # fmt: skip
        where = f"with {', '.join(diff)}: " if diff else ""
        for version in sorted(versions, reverse=True)[:_PER_IDENTITY]:
            ranks = versions[version]
            world = next(iter(ranks.values())).world_size
            if len(ranks) < world:
                missing = sorted(set(range(world)) - set(ranks))
                out.append(f"{where}{len(ranks)} of {world} ranks published version {version} (missing {missing})")
            elif version < min_version:
                out.append(f"{where}version {version} is complete but older than {min_version}")
            else:
                out.append(f"{where}version {version} is complete")
    return out
