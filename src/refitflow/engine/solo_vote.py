"""The engine vote of an engine of one rank: its own ballot decides, at once; it is never in doubt.

A host that runs every rank through an ``EngineMember`` (the integrations do) uses it when an engine
has a single rank, so one code path prepares, votes and commits whatever the engine's size.
"""

from __future__ import annotations

from refitflow.engine.vote import AttemptIds, Ballot, Decision, Verdict, decide, why

__all__ = ["SoloVote"]


class SoloVote(AttemptIds):
    """``VoteChannel`` of a one-rank engine."""

    rank, size = 0, 1

    def __init__(self) -> None:
        self._last: Verdict | None = None

    async def vote(self, ballot: Ballot, timeout: float) -> Verdict:
        attempt = self._begin_attempt()
        decision = decide([ballot])
        version = ballot.version if decision is Decision.COMMIT else None
        self._last = Verdict(attempt, decision, version, why([ballot]))
        return self._last

    async def resolve(self, attempt: int, timeout: float) -> Verdict:
        """The verdict of this rank's last vote; any other attempt was never decided, so it is over: ABORT."""
        if self._last is not None and self._last.attempt == attempt:
            return self._last
        return Verdict(attempt, Decision.ABORT, None, f"attempt {attempt} was never voted on this one-rank engine")
