"""Transactions: begin → (apply) → prepare → finish, or abort. One open at a time per rank.

``prepare`` checks coverage and makes nothing visible; ``finish`` makes the version visible. An
engine-wide vote goes between the two. The version of every ``begin`` must exceed the last one begun
on this rank (a failed attempt consumes its number).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from refitflow.core.errors import AlreadyCommittedError, VersionError
from refitflow.refit.coverage import CoverageIndex, CoverageTracker
from refitflow.refit.destination import ApplyMode, Destination
from refitflow.refit.fence import Fence, FenceState
from refitflow.refit.held import Holding

__all__ = ["Ledger", "Transaction", "TxnState"]


class TxnState(enum.StrEnum):
    OPEN = "open"
    PREPARED = "prepared"
    COMMITTED = "committed"
    ABORTED = "aborted"


@dataclass(eq=False, kw_only=True)
class Transaction:
    version: int
    revision: str
    coverage: CoverageTracker
    state: TxnState = TxnState.OPEN
    wrote: bool = False  # set before the first byte lands in a destination
    copying: bool = False  # shadow_commit="copy": the live storage is being overwritten (set before it is)
    reason: str | None = None
    holding: Holding | None = None  # (digest geometry, digests) of the version, for delta refits
    fence_before: FenceState = field(default=FenceState.READY)
    fence_reason_before: str | None = None


class Ledger:
    """The transaction state of one rank: what was begun, what is committed, the fence."""

    def __init__(self, destination: Destination, fence: Fence) -> None:
        self.destination = destination
        self.fence = fence
        self.last_begun: int | None = None
        self.committed_version: int | None = None
        self.committed_revision: str | None = None
        self.open: Transaction | None = None
        self.first_failure: str | None = None  # the first failure since the last commit
        self._coverage: tuple[dict[str, int], CoverageIndex] | None = None  # expected counts, indexed once

    def begin(self, version: int, revision: str) -> Transaction:
        if self.open is not None:
            raise VersionError(f"transaction for version {self.open.version} is still open", version=version)
        if version == self.committed_version and self.fence.state is FenceState.READY:
            raise AlreadyCommittedError(f"this rank already serves version {version}", version=version)
        if self.last_begun is not None and version <= self.last_begun:
            raise VersionError(f"version must increase: last begun on this rank was {self.last_begun}", version=version)
        self.last_begun = version
        txn = Transaction(
            version=version,
            revision=revision,
            coverage=CoverageTracker(self._coverage_index()),
            fence_before=self.fence.state,
            fence_reason_before=self.fence.reason,
        )
        self.open = txn
        if self.destination.mode is ApplyMode.IN_PLACE:
            self.fence.set(FenceState.UPDATING, f"writing version {version} in place")
        return txn

    def _coverage_index(self) -> CoverageIndex:
        expected = self.destination.expected  # set once, when a destination is made
        if self._coverage is None or self._coverage[0] is not expected:
            self._coverage = (expected, CoverageIndex(expected))
        return self._coverage[1]

    def prepare(self, txn: Transaction) -> None:
        """Everything verified, nothing visible yet."""
        self._expect(txn, TxnState.OPEN)
        txn.coverage.check(version=txn.version)
        txn.state = TxnState.PREPARED

    def copying(self, txn: Transaction) -> None:
        """``shadow_commit="copy"``: close the fence before the shadows are copied into the live storage."""
        self._expect(txn, TxnState.PREPARED)
        txn.copying = True
        self.fence.set(FenceState.UPDATING, f"copying version {txn.version} into the live parameters")

    def finish(self, txn: Transaction) -> None:
        """Make the prepared version visible."""
        self._expect(txn, TxnState.PREPARED)
        self.destination.holdings.committed(self.destination.generation, txn.holding)
        if self.destination.mode is ApplyMode.SHADOW and not self.destination.copies_at_commit:
            self.destination.swap()  # copy mode: the receiver copied the shadows into the live storage already
        txn.state = TxnState.COMMITTED
        self.committed_version = txn.version
        self.committed_revision = txn.revision
        self.open = None
        self.first_failure = None
        self.fence.set(FenceState.READY)

    def abort(self, txn: Transaction, reason: str) -> None:
        """Undo what can be undone: in place, a rank that wrote anything stays fenced."""
        if txn.state in (TxnState.COMMITTED, TxnState.ABORTED):
            return
        txn.state = TxnState.ABORTED
        txn.reason = reason
        self.first_failure = self.first_failure or reason
        if self.open is txn:
            self.open = None
        if txn.wrote or txn.copying:  # what the written storage holds is unknown now
            self.destination.holdings.overwritten(self.destination.generation, live_too=txn.copying)
        if txn.copying:
            reason = f"version {txn.version} aborted while copied into the live storage: {reason}"
            self.fence.set(FenceState.FENCED, reason)
        elif self.destination.mode is ApplyMode.IN_PLACE:
            if txn.wrote:
                self.fence.set(FenceState.FENCED, f"version {txn.version} aborted after a partial write: {reason}")
            else:
                self.fence.set(txn.fence_before, txn.fence_reason_before)
        elif self.fence.state is not txn.fence_before:  # shadow: only a doubt closed it
            self.fence.set(txn.fence_before, txn.fence_reason_before)

    def doubt(self, txn: Transaction, reason: str) -> None:
        """A prepared version whose engine verdict this rank does not know: it stays prepared and the
        fence closes (``updating``) in both modes — the engine's peers may serve it already, or not."""
        self._expect(txn, TxnState.PREPARED)
        self.fence.set(FenceState.UPDATING, reason)

    def fence_for_peers(self, reason: str) -> None:
        """Close the fence because the engine's peers are inconsistent with this rank."""
        self.first_failure = self.first_failure or reason
        self.fence.set(FenceState.FENCED, reason)

    def _expect(self, txn: Transaction, state: TxnState) -> None:
        if txn is not self.open or txn.state is not state:
            raise VersionError(f"transaction is {txn.state.value}, expected {state.value}", version=txn.version)
