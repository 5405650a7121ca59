"""The receiver's compile filter: allowed compile targets and a required subset of compile metadata."""

from __future__ import annotations

from refitflow.core.errors import PlanError
from refitflow.core.types import Publication
from refitflow.planner.limits import Limits

__all__ = ["check_compile"]


def check_compile(pub: Publication, limits: Limits) -> None:
    """Refuse a publication compiled for a target (or with metadata) this receiver does not accept."""
    if limits.compile_targets is None and not limits.compile_metadata:
        return
    want = dict(limits.compile_metadata)
    for m in pub.manifests:
        for s in m.shards:
            target = s.compile_target or pub.identity.compile_target
            if limits.compile_targets is not None and target not in limits.compile_targets:
                raise PlanError(
                    f"compile target {target!r} is not one of {sorted(limits.compile_targets)}",
                    tensor=s.name, version=pub.version,
                )  # fmt: skip
            have = dict(s.compile_metadata)
            wrong = sorted(k for k, v in want.items() if have.get(k) != v)
            if wrong:
                raise PlanError(f"compile metadata differs on {wrong}", tensor=s.name, version=pub.version)
