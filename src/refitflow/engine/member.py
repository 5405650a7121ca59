"""An engine member: one inference rank refitting together with the other ranks of its engine.

What a member needs of its receiver is small (``Preparer``): ``prepare`` (run the pipeline to a
prepared transaction), ``finish`` (make it visible), ``abort`` (abandon it), and the ``ledger``
(``last_begun``, ``open``, ``doubt``, ``fence_for_peers``). ``rf.Receiver`` is one; a streaming
receiver is another as long as it keeps the same four.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import anyio

from refitflow.core.errors import AlreadyCommittedError, RefitError, VersionError
from refitflow.engine.vote import Ballot, Decision, Verdict, VoteChannel
from refitflow.refit.transaction import Ledger, Transaction

__all__ = ["EngineMember", "EngineOutcome", "Preparer"]


class Preparer(Protocol):
    """The receiver side of an engine member."""

    ledger: Ledger

    async def prepare(self, min_version: int | None = None, *, timeout: float = 60.0) -> tuple[Transaction, Any]:
        """Run a refit to a prepared transaction (nothing visible); raise ``RefitError`` on failure."""
        ...

    async def finish(self, txn: Transaction) -> None: ...
    async def abort(self, txn: Transaction, reason: str) -> None: ...


@dataclass(frozen=True, kw_only=True)
class EngineOutcome:
    decision: Decision  # the engine's verdict as this rank learned it, or IN_DOUBT
    committed: bool  # this rank now serves ``version``
    version: int | None
    attempt: int  # the vote's attempt id
    reason: str  # why the engine did not commit (empty when it did)
    result: Any  # this rank's prepared refit (a RefitResult), when it got that far
    error: BaseException | None  # this rank's own failure, if any
    # ``prepare`` only: the engine decided COMMIT and this version waits for ``commit`` (not yet visible)
    transaction: Transaction | None = field(default=None, repr=False, compare=False)


@dataclass(frozen=True)
class _Doubt:
    attempt: int
    txn: Transaction
    result: Any


class EngineMember:
    """Wraps a receiver: prepare, vote, then finish or abort as the engine's verdict says.

    A rank that voted ready and could not learn the verdict is *in doubt*: its version stays
    prepared, unseen, and its fence ``updating``. ``resolve`` (the agent calls it in the background)
    or the next ``refit`` asks the peers; when nobody can tell within ``resolve_timeout`` the next
    refit abandons the doubtful version (never commits it) and the rank stays fenced until a newer
    version commits engine-wide.
    """

    def __init__(self, receiver: Preparer, channel: VoteChannel, *, vote_timeout: float = 30.0,
                 resolve_timeout: float = 5.0) -> None:  # fmt: skip
        self.receiver = receiver
        self.channel = channel
        self.vote_timeout = vote_timeout
        self.resolve_timeout = resolve_timeout
        self._doubt: _Doubt | None = None
        self._lock = anyio.Lock()

    @property
    def in_doubt(self) -> int | None:
        """The attempt whose verdict this rank does not know yet (``None``: none)."""
        return None if self._doubt is None else self._doubt.attempt

    async def refit(self, min_version: int | None = None, *, timeout: float = 60.0) -> EngineOutcome:
        """Prepare, vote, then commit or abort as the engine decides (``prepare`` then ``commit``)."""
        outcome = await self.prepare(min_version, timeout=timeout)
        return await self.commit(outcome) if outcome.transaction is not None else outcome

    async def prepare(self, min_version: int | None = None, *, timeout: float = 60.0) -> EngineOutcome:
        """Prepare this rank and vote. On an ABORT verdict the version is abandoned here; on COMMIT it
        stays prepared (``outcome.transaction``) until ``commit`` makes it visible — for hosts whose
        commit is a call of its own (vLLM's ``finish_weight_update``). The verdict is final either way:
        a host that then gives up calls ``abort``, which leaves this rank fenced."""
        async with self._lock:
            await self._leave_doubt()
            ledger = self.receiver.ledger
            begun_before = ledger.last_begun
            txn: Transaction | None = None
            result: Any = None
            error: BaseException | None = None
            try:
                txn, result = await self.receiver.prepare(min_version, timeout=timeout)
            except RefitError as exc:  # the rank still votes, on its way out of the failure
                error = exc
            except BaseException:  # cancelled: still vote (shielded, bounded), then propagate
                with anyio.CancelScope(shield=True):
                    await self.channel.vote(self._ballot(ledger.last_begun != begun_before, None), self.vote_timeout)
                raise
            began = ledger.last_begun != begun_before
            try:
                verdict = await self.channel.vote(self._ballot(began, txn), self.vote_timeout)
            except BaseException:  # cancelled mid-vote: a ready ballot may have counted, so in doubt
                if txn is not None:
                    self._hold(self.channel.attempt, txn, result)
                raise
            return await self._apply(verdict, txn, began, result, error, defer=True)

    async def commit(self, outcome: EngineOutcome) -> EngineOutcome:
        """Make visible the version a ``prepare`` left waiting under a COMMIT verdict."""
        if outcome.transaction is None:
            raise VersionError("nothing prepared to commit: the engine vote did not decide to commit here")
        async with self._lock:
            await self.receiver.finish(outcome.transaction)
        return replace(outcome, committed=True, transaction=None)

    async def abort(self, outcome: EngineOutcome, reason: str) -> None:
        """Give up a version the engine decided to commit (the host will not commit it): this rank drops
        it and stays fenced, since its peers may serve it."""
        if outcome.transaction is None:
            return
        async with self._lock:
            await self.receiver.abort(outcome.transaction, reason)
            self.receiver.ledger.fence_for_peers(
                f"version {outcome.transaction.version} was committed by the engine and abandoned here: {reason}"
            )

    async def resolve(self, timeout: float | None = None, *, defer: bool = False) -> EngineOutcome | None:
        """Ask the peers for the verdict this rank is in doubt about; the outcome once learned.

        ``None`` when not in doubt, still in doubt, or a refit is running (it resolves first itself).
        ``defer``: a COMMIT leaves the version prepared (``outcome.transaction``) for ``commit``, as
        ``prepare`` does.
        """
        if self._doubt is None or self._lock.locked():
            return None
        async with self._lock:
            return await self._resolve(self.resolve_timeout if timeout is None else timeout, defer=defer)

    async def _resolve(self, timeout: float, *, defer: bool = False) -> EngineOutcome | None:
        doubt = self._doubt
        if doubt is None:
            return None
        verdict = await self.channel.resolve(doubt.attempt, timeout)
        if verdict.decision is Decision.IN_DOUBT:
            return None
        self._doubt = None
        return await self._apply(verdict, doubt.txn, True, doubt.result, None, defer=defer)

    async def _leave_doubt(self) -> None:
        """Before a new attempt: learn the doubtful verdict, or abandon that version (fenced, never committed)."""
        if self._doubt is None:
            return
        await self._resolve(self.resolve_timeout)
        doubt, self._doubt = self._doubt, None
        if doubt is not None:
            reason = f"abandoned version {doubt.txn.version}: the verdict of attempt {doubt.attempt} is unknown"
            await self.receiver.abort(doubt.txn, reason)
            self.receiver.ledger.fence_for_peers(reason)

    def _ballot(self, began: bool, txn: Transaction | None) -> Ballot:
        last = self.receiver.ledger.last_begun
        version = txn.version if txn is not None else (last if began and last is not None else -1)
        return Ballot(ready=txn is not None, began=began, version=version)

    def _hold(self, attempt: int, txn: Transaction, result: Any) -> None:
        self.receiver.ledger.doubt(txn, f"in doubt: version {txn.version} prepared, attempt {attempt} undecided")
        self._doubt = _Doubt(attempt, txn, result)

    async def _apply(self, v: Verdict, txn: Transaction | None, began: bool, result: Any,
                     error: BaseException | None, *, defer: bool = False) -> EngineOutcome:  # fmt: skip
        recv, ledger = self.receiver, self.receiver.ledger
        decision = v.decision
        if decision is Decision.IN_DOUBT and txn is None:
            decision = Decision.ABORT  # COMMIT needed this rank's ready ballot: it cannot have happened

        def outcome(committed: bool, version: int | None) -> EngineOutcome:
            reason = "" if committed else (v.reason or decision.value)
            return EngineOutcome(decision=decision, committed=committed, version=version, attempt=v.attempt,
                                 reason=reason, result=result, error=error)  # fmt: skip

        if decision is Decision.COMMIT and txn is not None and txn.version == v.version:
            if defer:
                return replace(outcome(False, txn.version), reason="", transaction=txn)
            await recv.finish(txn)
            return outcome(True, txn.version)
        if decision is Decision.IN_DOUBT:
            assert txn is not None
            self._hold(v.attempt, txn, result)
            return outcome(False, txn.version)
        if txn is not None:
            await recv.abort(txn, f"engine vote: {v.reason or decision.value}")
        if decision is Decision.NOTHING and isinstance(error, AlreadyCommittedError) and not began:
            # nobody began, and this rank serves the very version asked for (a repeated refit): done here
            return outcome(True, ledger.committed_version)
        if decision is Decision.COMMIT:  # never, unless a verdict was forged
            ledger.fence_for_peers(f"the engine committed version {v.version}, which this rank did not prepare")
        elif decision is Decision.ABORT and not began:
            ledger.fence_for_peers(f"a peer began and aborted ({v.reason or 'no reason given'})")
        return outcome(False, ledger.last_begun if began else None)
