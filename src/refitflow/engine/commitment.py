"""The engine's atomic commitment, as a state machine without sockets or clocks (the ZMQ vote drives it).

One rank, the *coordinator* (rank 0), holds a ``Register``: the ballots of each undecided attempt
and, once written, its one ``Verdict``, which never changes. Every rank (the coordinator too) sends
its ballot to the register; the register writes

- the rule's verdict (``decide``) once it holds every ballot, or ABORT as soon as a ballot that is
  not ready and a ballot that began are both in (the outcome can no longer be anything else);
- ABORT when the coordinator's own deadline passes, when a participant past its deadline asks for
  it, when the coordinator begins a later attempt, or when it is asked about an earlier attempt it
  never voted in (it never wrote COMMIT there: COMMIT needs its own ballot).

A rank learns the verdict from the register or from any peer that learned it, and nothing else:
no rank decides alone from the ballots it happens to hold. A rank whose deadline passed without
the verdict sends the register an abort request; if no verdict comes back it is *in doubt* and
asks every peer (``query``) until one answers. A register that restarted does not know the
attempts before its first one and never answers for them (it cannot tell an ABORT from a COMMIT
it forgot); nor does it answer for attempts older than the verdicts it keeps.

``Node`` is one rank: ``vote``/``tick``/``expire``/``query`` produce the messages to send,
``receive`` files a message and produces the answers, ``verdict`` reads what this rank knows.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from dataclasses import dataclass

from refitflow.engine.vote import Ballot, Decision, Verdict, decide, why

__all__ = ["COORDINATOR", "Kind", "Message", "Node", "Register"]

COORDINATOR = 0
KEEP = 256  # verdicts a rank remembers (older attempts: unknown)
UNDECIDED = 8  # attempts whose ballots the register holds at once (more: dropped, the senders resend)


class Kind(enum.StrEnum):
    BALLOT = "ballot"  # a rank's ballot, to the coordinator
    ABORT = "abort"  # a rank past its deadline asks the coordinator to write ABORT if nothing is written
    QUERY = "query"  # a rank in doubt asks a peer for the verdict
    DECISION = "decision"  # the verdict, from whoever knows it


@dataclass(frozen=True, slots=True)
class Message:
    kind: Kind
    attempt: int
    sender: int
    to: int
    ballot: Ballot | None = None  # BALLOT
    verdict: Verdict | None = None  # DECISION


class Register:
    """The coordinator's record: written once per attempt, first writer wins."""

    def __init__(self, size: int, *, keep: int = KEEP) -> None:
        self.size = size
        self.keep = keep
        self.ballots: dict[int, dict[int, Ballot]] = {}
        self.verdicts: OrderedDict[int, Verdict] = OrderedDict()
        self.first: int | None = None  # the first attempt this incarnation voted in
        self.current: int | None = None  # the newest attempt it voted in
        self.forgotten: int | None = None  # every attempt ≤ this may have been forgotten

    def knowable(self, attempt: int) -> bool:
        """Whether a missing verdict here means nothing was written (not: written, then lost)."""
        if self.first is None or attempt < self.first:
            return False  # before this incarnation voted: it may have written COMMIT before a restart
        return self.forgotten is None or attempt > self.forgotten

    def verdict(self, attempt: int) -> Verdict | None:
        return self.verdicts.get(attempt)

    def own(self, attempt: int, ballot: Ballot, rank: int) -> Verdict | None:
        """The coordinator votes in ``attempt``: every earlier undecided attempt can only abort now."""
        if self.first is None:
            self.first = attempt
        self.current = attempt if self.current is None else max(self.current, attempt)
        for earlier in sorted(a for a in self.ballots if a < attempt):
            if self.knowable(earlier):
                self._write(Verdict(earlier, Decision.ABORT, None, f"superseded by attempt {attempt}"))
            else:
                del self.ballots[earlier]  # from before this incarnation: not ours to write
        return self.post(attempt, rank, ballot)

    def post(self, attempt: int, rank: int, ballot: Ballot) -> Verdict | None:
        """File a ballot; the verdict if one is (or just got) written."""
        if attempt in self.verdicts:
            return self.verdicts[attempt]
        if self.first is not None and not self.knowable(attempt):
            return None
        if self.current is not None and attempt < self.current:
            return self.expire(attempt, "the coordinator had moved on to a later attempt")
        if attempt not in self.ballots and len(self.ballots) >= UNDECIDED:
            return None  # a flood of attempts: dropped; a real sender says it again
        ballots = self.ballots.setdefault(attempt, {})
        ballots.setdefault(rank, ballot)  # one ballot per rank and attempt: the first counts
        if self.first is None:
            return None  # before its own first vote the register writes nothing
        present = [ballots.get(r) for r in range(self.size)]
        if None not in present:
            v = decide(present)
            version = next(b.version for b in ballots.values()) if v is Decision.COMMIT else None
            return self._write(Verdict(attempt, v, version, why(present)))
        known = [b for b in present if b is not None]
        if any(not b.ready for b in known) and any(b.began for b in known):
            return self._write(Verdict(attempt, Decision.ABORT, None, why(present, early=True)))
        return None

    def expire(self, attempt: int, reason: str) -> Verdict | None:
        """Write ABORT unless something is written; ``None`` for an attempt this register cannot know."""
        if attempt in self.verdicts:
            return self.verdicts[attempt]
        if not self.knowable(attempt):
            return None
        if attempt in self.ballots:
            reason = f"{reason}; {why([self.ballots[attempt].get(r) for r in range(self.size)])}"
        return self._write(Verdict(attempt, Decision.ABORT, None, reason))

    def lookup(self, attempt: int) -> Verdict | None:
        """The verdict for a query: an earlier attempt this coordinator never voted in aborts now."""
        if attempt in self.verdicts:
            return self.verdicts[attempt]
        if self.current is not None and attempt < self.current:
            return self.expire(attempt, "the coordinator never voted in this attempt")
        return None

    def _write(self, verdict: Verdict) -> Verdict:
        self.ballots.pop(verdict.attempt, None)
        self.verdicts[verdict.attempt] = verdict
        while len(self.verdicts) > self.keep:
            oldest = min(self.verdicts)
            del self.verdicts[oldest]
            self.forgotten = oldest if self.forgotten is None else max(self.forgotten, oldest)
        return verdict


class Node:
    """One rank of the protocol (``rank == COORDINATOR`` holds the register)."""

    def __init__(self, rank: int, size: int, *, keep: int = KEEP) -> None:
        self.rank, self.size = rank, size
        self.register = Register(size, keep=keep) if rank == COORDINATOR else None
        self.known: OrderedDict[int, Verdict] = OrderedDict()
        self.keep = keep
        self.ballots: dict[int, Ballot] = {}  # this rank's ballot per attempt it voted in (recent)
        self.conflicts = 0  # verdicts that contradicted one already learned (never, unless forged)

    def verdict(self, attempt: int) -> Verdict | None:
        return self.known.get(attempt)

    def vote(self, attempt: int, ballot: Ballot) -> list[Message]:
        self.ballots[attempt] = ballot
        while len(self.ballots) > UNDECIDED:
            del self.ballots[min(self.ballots)]
        if self.register is not None:
            return self._written(self.register.own(attempt, ballot, self.rank), to=None)
        return self.tick(attempt)

    def tick(self, attempt: int) -> list[Message]:
        """Say it again (nothing is acknowledged except by the verdict itself)."""
        if attempt in self.known or self.register is not None or attempt not in self.ballots:
            return []
        return [Message(Kind.BALLOT, attempt, self.rank, COORDINATOR, ballot=self.ballots[attempt])]

    def expire(self, attempt: int, reason: str = "deadline passed") -> list[Message]:
        """This rank's deadline for ``attempt`` passed: the coordinator writes ABORT, a participant asks it to."""
        if attempt in self.known:
            return []
        if self.register is not None:
            return self._written(self.register.expire(attempt, f"rank {self.rank}: {reason}"), to=None)
        return [Message(Kind.ABORT, attempt, self.rank, COORDINATOR)]

    def query(self, attempt: int) -> list[Message]:
        """In doubt: ask every peer (the coordinator answers for what it can know; others if they learned it)."""
        if attempt in self.known:
            return []
        if self.register is not None:
            return self._written(self.register.lookup(attempt), to=None)
        return [Message(Kind.QUERY, attempt, self.rank, p) for p in range(self.size) if p != self.rank]

    def receive(self, m: Message) -> list[Message]:
        if m.kind is Kind.DECISION:
            assert m.verdict is not None
            self._learn(m.verdict)
            return []
        if self.register is not None:
            if m.kind is Kind.BALLOT:
                assert m.ballot is not None
                v = self.register.post(m.attempt, m.sender, m.ballot)
            elif m.kind is Kind.ABORT:
                v = self.register.expire(m.attempt, f"rank {m.sender} passed its deadline")
            else:
                v = self.register.lookup(m.attempt)
            return self._written(v, to=m.sender)
        known = self.known.get(m.attempt)
        return [] if known is None else [self._tell(known, m.sender)]

    def _written(self, v: Verdict | None, *, to: int | None) -> list[Message]:
        """The register answered: learn it; tell the asker, and everyone when it is news."""
        if v is None:
            return []
        news = v.attempt not in self.known
        self._learn(v)
        peers = [p for p in range(self.size) if p != self.rank]
        return [self._tell(v, p) for p in (peers if news else [to] if to is not None else [])]

    def _tell(self, v: Verdict, to: int) -> Message:
        return Message(Kind.DECISION, v.attempt, self.rank, to, verdict=v)

    def _learn(self, v: Verdict) -> None:
        if v.decision is Decision.IN_DOUBT:
            return
        had = self.known.get(v.attempt)
        if had is not None:
            if (had.decision, had.version) != (v.decision, v.version):
                self.conflicts += 1  # the first verdict learned stands
            return
        self.known[v.attempt] = v
        while len(self.known) > self.keep:
            del self.known[min(self.known)]
