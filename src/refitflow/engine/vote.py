"""The engine vote's vocabulary: ballots, the rule, verdicts, and the channel a member votes through.

Every rank votes exactly once per attempt — ``Ballot(ready, began, version)`` — also on its way out
of a failure. The rule (``decide``) over every rank's ballot:

- every rank ready for the same version → COMMIT;
- otherwise ABORT if any rank began (in place: fenced; shadow: the old version serves; a rank that
  refused at begin while a peer began is fenced too);
- nobody began → NOTHING.

Ranks never apply the rule to the ballots they happen to hold: one register per attempt (the
coordinator's in ``ZmqVote``, the c10d store's in ``GlooVote``) is written once, and every rank
learns the ``Verdict`` from it (``engine/commitment.py`` has the protocol and its failure cases).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from refitflow.core.errors import ConfigError, ManifestError
from refitflow.core.wire import decode

__all__ = ["AttemptIds", "Ballot", "Decision", "Verdict", "VoteChannel", "decide", "decode_object", "why"]


@dataclass(frozen=True, slots=True)
class Ballot:
    ready: bool
    began: bool
    version: int  # -1 when the rank did not get as far as choosing one


class Decision(enum.StrEnum):
    COMMIT = "commit"
    ABORT = "abort"
    NOTHING = "nothing"
    IN_DOUBT = "in_doubt"  # not a decision: this rank voted and has not learned the verdict yet


@dataclass(frozen=True, slots=True)
class Verdict:
    attempt: int
    decision: Decision  # COMMIT, ABORT, NOTHING, or IN_DOUBT (this rank does not know it)
    version: int | None = None  # COMMIT: the version every rank commits
    reason: str = ""


def decide(ballots: Sequence[Ballot | None]) -> Decision:
    """The rule over every rank's ballot; ``None`` is a rank whose ballot never came (counts as began)."""
    if all(b is not None and b.ready for b in ballots) and len({b.version for b in ballots if b}) == 1:
        return Decision.COMMIT
    if any(b is None or b.began for b in ballots):
        return Decision.ABORT
    return Decision.NOTHING


def why(ballots: Sequence[Ballot | None], *, early: bool = False) -> str:
    """Why these ballots do not commit, in words (empty when they do); long lists of ranks are cut (a reason
    travels in at most 500 characters).

    ``early``: the verdict was written before every ballot came (a rank that began is not ready), so a
    missing ballot is one not waited for, not one lost.
    """
    missing = _ranks([i for i, b in enumerate(ballots) if b is None])
    not_ready = _ranks([i for i, b in enumerate(ballots) if b is not None and not b.ready])
    versions = sorted({b.version for b in ballots if b is not None and b.ready})
    parts = []
    if missing and not early:
        parts.append(f"no ballot of ranks {missing} had been read by the coordinator by its deadline")  # sent or not
    if not_ready:
        parts.append(f"ranks {not_ready} not ready")
    if len(versions) > 1:
        parts.append(f"ranks prepared different versions {_ranks(versions)}")
    if missing and early:
        parts.append(f"decided without waiting for ranks {missing}")
    return "; ".join(parts)


def _ranks(values: list[int], most: int = 8) -> str:
    """``[0, 1, 2]``, or ``[0, 1, 2, 3, 4, 5, 6, 7 and 24 more]`` when there are more than ``most``."""
    if len(values) <= most:
        return str(values) if values else ""
    return f"[{', '.join(map(str, values[:most]))} and {len(values) - most} more]"


class VoteChannel(Protocol):
    """How an ``EngineMember`` votes. Both channels also have ``set_attempt(n)`` (a driver's ids)."""

    rank: int
    size: int

    @property
    def attempt(self) -> int:
        """The id of the last attempt this rank voted in."""
        ...

    async def vote(self, ballot: Ballot, timeout: float) -> Verdict:
        """Vote in the next attempt; its verdict, or IN_DOUBT when this rank could not learn it in time.

        A rank whose ballot was not ready may treat IN_DOUBT as ABORT (COMMIT needed its ballot).
        """
        ...

    async def resolve(self, attempt: int, timeout: float) -> Verdict:
        """Learn the verdict of an earlier ``attempt`` this rank is in doubt about (IN_DOUBT: still unknown)."""
        ...


class AttemptIds:
    """Attempt ids of a channel: they count votes, or a driver sets the next one (it must increase)."""

    _attempt = 0
    _next: int | None = None

    @property
    def attempt(self) -> int:
        """The id of the last attempt this rank voted in."""
        return self._attempt

    def set_attempt(self, attempt: int) -> None:
        """The id of the next vote (must increase): a driver's command id keeps ranks in step."""
        if attempt <= self._attempt:
            raise ConfigError(f"vote attempt {attempt} does not increase (last was {self._attempt})")
        self._next = attempt

    def _begin_attempt(self) -> int:
        attempt = self._next if self._next is not None else self._attempt + 1
        self._attempt, self._next = attempt, None
        return attempt


def decode_object(frame: bytes, limit: int, what: str) -> dict[str, Any]:
    """A JSON object of at most ``limit`` bytes from a peer (``ValueError`` for anything else)."""
    if len(frame) > limit:
        raise ValueError(f"a {len(frame)}-byte frame is not a {what}")
    try:
        m = decode(frame)
    except ManifestError as exc:
        raise ValueError(str(exc)) from exc
    if not isinstance(m, dict):
        raise ValueError(f"a {what} is a JSON object")
    return m
