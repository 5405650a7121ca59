"""An engine member: one inference rank refitting together with the other ranks of its engine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import anyio

from refitflow.api.receiver import ReceiverStatus, RefitResult
from refitflow.core.errors import RefitError
from refitflow.engine.vote import Ballot, Decision, VoteChannel, decide
from refitflow.pipeline.transaction import Ledger, Transaction

__all__ = ["EngineMember", "EngineOutcome", "Preparing"]


class Preparing(Protocol):
    """What a member drives: ``rf.Receiver`` (pull) or ``rf.StreamReceiver`` (push stream)."""

    ledger: Ledger

    @property
    def status(self) -> ReceiverStatus: ...
    async def prepare(
        self, min_version: int | None = None, *, timeout: float = 60.0
    ) -> tuple[Transaction, RefitResult]: ...
    async def finish(self, txn: Transaction) -> None: ...
    async def abort(self, txn: Transaction, reason: str) -> None: ...


@dataclass(frozen=True, kw_only=True)
class EngineOutcome:
    decision: Decision
    committed: bool  # this rank now serves ``version``
    version: int | None
    ballots: tuple[Ballot | None, ...]
    result: RefitResult | None  # this rank's prepared refit, when it got that far
    error: BaseException | None  # this rank's own failure, if any


class EngineMember:
    """Wraps a receiver: prepare, vote with the engine's peers, then finish or abort together."""

    def __init__(self, receiver: Preparing, channel: VoteChannel, *, vote_timeout: float = 30.0) -> None:
        self.receiver = receiver
        self.channel = channel
        self.vote_timeout = vote_timeout

    async def refit(self, min_version: int | None = None, *, timeout: float = 60.0) -> EngineOutcome:
        recv = self.receiver
        begun_before = recv.ledger.last_begun
        txn: Transaction | None = None
        result: RefitResult | None = None
        error: BaseException | None = None
        try:
            txn, result = await recv.prepare(min_version, timeout=timeout)
        except RefitError as exc:  # the rank still votes, on its way out of the failure
            error = exc
        except BaseException:  # cancelled: still vote (shielded, bounded), then propagate
            with anyio.CancelScope(shield=True):
                await self._vote(recv.ledger.last_begun != begun_before, None)
            raise
        began = recv.ledger.last_begun != begun_before
        ballots = await self._vote(began, txn)
        decision = decide(ballots)
        if decision is Decision.COMMIT and txn is not None:
            await recv.finish(txn)
            return EngineOutcome(
                decision=decision, committed=True, version=txn.version, ballots=tuple(ballots), result=result,
                error=None,
            )  # fmt: skip
        if txn is not None:
            await recv.abort(txn, f"engine vote: {_why(ballots)}")
        elif decision is Decision.ABORT and not began:
            recv.ledger.fence_for_peers(f"a peer began and aborted ({_why(ballots)})")
        version = recv.ledger.last_begun if began else None
        return EngineOutcome(
            decision=decision, committed=False, version=version, ballots=tuple(ballots), result=result, error=error
        )

    async def _vote(self, began: bool, txn: Transaction | None) -> list[Ballot | None]:
        version = txn.version if txn is not None else (self.receiver.ledger.last_begun if began else -1)
        ballot = Ballot(ready=txn is not None, began=began, version=version if version is not None else -1)
        return await self.channel.exchange(ballot, self.vote_timeout)


def _why(ballots: list[Ballot | None]) -> str:
    missing = [i for i, b in enumerate(ballots) if b is None]
    not_ready = [i for i, b in enumerate(ballots) if b is not None and not b.ready]
    versions = sorted({b.version for b in ballots if b is not None and b.ready})
    parts = []
    if missing:
        parts.append(f"ranks {missing} did not vote")
    if not_ready:
        parts.append(f"ranks {not_ready} not ready")
    if len(versions) > 1:
        parts.append(f"ranks prepared different versions {versions}")
    return "; ".join(parts) or "aborted"
