"""A version's digest vector for a plan: decoded from a whole publication's manifests, or — from a registry across
the network, which answers a version as its ``core.records.Outline`` — fetched as the plan's part: every digest
of the shards the plan reads while its checks are being made (its first version), then only those its checks
read (``planner.checks.used_digests``, once per plan). The part's order is checked once against the layouts it is
applied to (``registry.client.fetched``), as ``planner.vector.digest_vector`` checks a whole publication's.
"""

from __future__ import annotations

import functools

import numpy as np

from refitflow.core.records import Outline
from refitflow.core.threads import off_loop
from refitflow.core.types import Publication
from refitflow.planner.checks import used_digests
from refitflow.planner.records import Plan

__all__ = ["version_digests"]


async def version_digests(plan: Plan, pub: Publication, *, placed: bool = True) -> np.ndarray:
    """``pub``'s digests of the shards ``plan`` reads, in the order its checks index them (native uint64);
    ``placed=False``: a whole publication's are taken without checking where its shards are (``Placing``)."""
    if not isinstance(pub, Outline):
        return await off_loop(functools.partial(plan.digests, pub, placed=placed))
    used: np.ndarray | None = plan.derived.get("used")  # type: ignore[assignment]
    if used is None and all(b.is_built for b in plan.buckets):
        used = await off_loop(used_digests, plan)
    return await pub.digests(plan.digest_order, plan.digest_count, used)
