"""An engine's place in a fleet, as a router sees it: may it take traffic?

Every fleet driver (``rf.Controller``, ``VllmFleet``, ``SglangFleet``) and every server's readiness route
report an engine in one of five states; only ``current`` takes traffic:

- ``current``: serves one committed version on every rank, the fleet's (where the fleet's is known; a
  server that never joined a fleet serves the weights it loaded, version None);
- ``catching_up``: joined (started or restarted) and not yet holding the fleet's version, or its ranks
  hold different versions: it refuses requests until it does;
- ``behind``: its last update failed and it still serves the version before (shadow mode): it could
  answer, but from an older policy than its peers;
- ``fenced``: a version failed part-way on a rank: it serves nothing until a later version commits;
- ``gone``: it did not answer (dead, hung or unreachable).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["STATES", "EngineState", "against", "gated", "rank_summary"]

STATES = ("current", "catching_up", "behind", "fenced", "gone")


@dataclass(frozen=True, kw_only=True)
class EngineState:
    engine: str
    state: str  # one of STATES
    version: int | None  # the version every rank serves (None: not one version, or none yet)
    reason: str | None = None  # why it is not current

    @property
    def ready(self) -> bool:
        """May a router send it requests."""
        return self.state == "current"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"ready": self.ready}


def rank_summary(engine: str, ranks: Sequence[dict[str, Any] | None], *, target: int | None = None,
                 joining: bool = False) -> EngineState:  # fmt: skip
    """An engine's state from its ranks' statuses (``committed_version``, ``fence``, optional ``reason``;
    None for a rank that did not answer). ``target``: the fleet's version, which a current engine holds;
    ``joining``: the engine joined (started, restarted, replaced) and has not committed a version since."""
    if any(r is None for r in ranks):
        missing = [i for i, r in enumerate(ranks) if r is None]
        return EngineState(engine=engine, state="gone", version=None, reason=f"ranks {missing} did not answer")
    answered = [r for r in ranks if r is not None]
    for i, r in enumerate(answered):
        if r.get("fence") == "fenced":
            why = r.get("reason") or "a version failed part-way"
            return EngineState(engine=engine, state="fenced", version=None, reason=f"rank {i} is fenced: {why}")
    versions = {r.get("committed_version") for r in answered}
    if len(versions) > 1:
        held = sorted(str(v) for v in versions)
        return EngineState(engine=engine, state="catching_up", version=None, reason=f"its ranks hold versions {held}")
    version = versions.pop()
    if joining and (version is None or target is None or version < target):
        to = f"to version {target}" if target is not None else "with the fleet"
        return EngineState(engine=engine, state="catching_up", version=version, reason=f"joining: catching up {to}")
    return against(EngineState(engine=engine, state="current", version=version), target)


def gated(engine: str, version: int | None, *, fenced: str | None, joining: str | None,
          behind: str | None) -> EngineState | None:  # fmt: skip
    """A server's state when one of its own gates keeps it from taking traffic — fenced, catching up, behind,
    checked in that order, each given as its reason or None — else None."""
    for state, reason in (("fenced", fenced), ("catching_up", joining), ("behind", behind)):
        if reason:
            return EngineState(engine=engine, state=state, version=None if state == "fenced" else version,
                               reason=reason)  # fmt: skip
    return None


def against(state: EngineState, target: int | None) -> EngineState:
    """``state`` measured against the fleet's version: a current engine short of ``target`` is behind."""
    if not state.ready or target is None or (state.version is not None and state.version >= target):
        return state
    held = "the weights it loaded" if state.version is None else f"version {state.version}"
    return EngineState(engine=state.engine, state="behind", version=state.version,
                       reason=f"serves {held}, the fleet is at {target}")  # fmt: skip
