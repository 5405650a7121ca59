"""What a refit reports (``RefitResult``, ``StageStats``) and a receiving rank's status (``ReceiverStatus``):
the records the pull receiver (``api.receiver``) and the push receiver (``push.receiver``) share; a pulled
refit's result is made from its ``graph.Outcome`` (``refit_result``)."""

from __future__ import annotations

from dataclasses import dataclass

from refitflow.planner.delta import delta_index
from refitflow.refit.graph import Outcome
from refitflow.refit.transaction import Ledger

__all__ = ["ReceiverStatus", "RefitResult", "StageStats", "refit_result"]


@dataclass(frozen=True, kw_only=True)
class StageStats:
    items: int
    nbytes: int
    seconds: float  # busy time of the stage (its work, not its waits)


@dataclass(frozen=True, kw_only=True)
class RefitResult:
    version: int
    revision: str
    nbytes: int  # bytes pulled (from the trainer or a relay; pieces read again counted again)
    ideal_bytes: int  # the bytes of this rank's slice alone (nbytes above it: widened or enclosing reads)
    unverified_bytes: int  # pulled bytes no whole digest block covered (verify="pulled" only)
    direct_bytes: int  # of which landed straight in their destination
    seconds: float  # from finding the publication to prepared (excludes waiting for it to appear)
    wait_seconds: float  # how long discovery waited for a complete version
    plan_cached: bool
    peak_staging_bytes: int
    stages: dict[str, StageStats]
    skipped_bytes: int = 0  # not pulled: unchanged since the version this rank holds (delta refits)
    rechecked_bytes: int = 0  # of the skipped, re-hashed where they lie
    repaired_bytes: int = 0  # of the re-hashed, changed behind refitflow's back and pulled again
    relay_bytes: int = 0  # of the pulled, read from an upstream relay (pipelined fan-out)
    rerouted_bytes: int = 0  # of the pulled, read from the trainer after a relay failed, stalled or sent bad bytes

    @property
    def gbps(self) -> float:
        """End-to-end GB/s (10^9 bytes per second)."""
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass(frozen=True, kw_only=True)
class ReceiverStatus:
    healthy: bool  # serving a complete version (fence not fenced)
    in_progress: bool
    committed_version: int | None
    fence: str
    first_failure: str | None  # the first failure since the last commit

    @classmethod
    def of(cls, ledger: Ledger) -> ReceiverStatus:
        """The status of the rank whose transactions ``ledger`` keeps."""
        return cls(
            healthy=ledger.fence.state.value != "fenced",
            in_progress=ledger.open is not None,
            committed_version=ledger.committed_version,
            fence=ledger.fence.state.value,
            first_failure=ledger.first_failure,
        )


def refit_result(outcome: Outcome, *, seconds: float, plan_cached: bool, peak_staging_bytes: int) -> RefitResult:
    """The result of a prepared pull refit: what its stages counted and measured."""
    attempt, t = outcome.attempt, outcome.tally
    plan, skips = attempt.plan, attempt.skips
    index = delta_index(plan) if skips is not None else None
    return RefitResult(
        version=attempt.txn.version, revision=attempt.txn.revision, nbytes=t.pulled,
        direct_bytes=sum(b.direct_bytes for b in plan.buckets), ideal_bytes=plan.ideal_bytes,
        unverified_bytes=t.unverified, seconds=seconds, wait_seconds=attempt.found.waited_s,
        plan_cached=plan_cached, peak_staging_bytes=peak_staging_bytes,
        stages={k: StageStats(items=m.items, nbytes=m.nbytes, seconds=m.seconds) for k, m in outcome.meters.items()
                if m.noted},
        skipped_bytes=skips.skipped_bytes(index) if skips is not None and index is not None else 0,
        rechecked_bytes=skips.rechecked_bytes(index) if skips is not None and index is not None else 0,
        repaired_bytes=t.repaired, relay_bytes=t.relayed, rerouted_bytes=t.rerouted,
    )  # fmt: skip
