"""Metrics seam: stages and the pipeline report through the small ``Observer`` Protocol.

``NULL_OBSERVER`` ignores everything; ``refitflow.metrics.prometheus.PrometheusMetrics`` exports
Prometheus metrics; tests pass their own observers (also to inject failures at a chosen stage).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

__all__ = [
    "BYTE_KINDS",
    "FRAME_KINDS",
    "NULL_OBSERVER",
    "OUTCOMES",
    "STAGES",
    "NullObserver",
    "Observer",
    "PublishObserver",
    "QueueStats",
]

STAGES = ("discover", "plan", "allocate", "pull", "translate", "apply", "verify", "commit")
OUTCOMES = ("committed", "aborted", "refused")
# why a push-stream frame was refused (``FrameError.kind``; ``ceiling``: sizes or allocation, out of step)
FRAME_KINDS = ("header", "command", "metadata", "entry", "mapping", "version", "ceiling")
# how a refit's bytes arrived, beyond pulling (RefitResult's *_bytes: delta refits, pipelined fan-out)
BYTE_KINDS = ("skipped", "rechecked", "repaired", "relayed", "rerouted")
QueueStats = Callable[[], tuple[int, int]]  # -> (items buffered, capacity)


class Observer(Protocol):
    def stage_enter(self, stage: str) -> None:
        """An item entered ``stage``."""

    def stage_item(self, stage: str, nbytes: int, seconds: float) -> None:
        """One item left ``stage`` after ``seconds`` of work, carrying ``nbytes``."""

    def transport_read(self, transport: str, nbytes: int, seconds: float) -> None:
        """One batch of reads of ``nbytes`` completed in ``seconds``."""

    def queues(self, queues: Mapping[str, QueueStats]) -> None:
        """The pipeline's queues while a refit runs (empty mapping when it ends)."""

    def fence_state(self, state: str) -> None:
        """The fence moved to ``state``."""

    def refit_outcome(self, outcome: str, version: int | None) -> None:
        """A refit ended: ``committed``, ``aborted`` or ``refused``."""

    def budget(self, used_bytes: int, peak_bytes: int, capacity_bytes: int) -> None:
        """Staging bytes held now, at peak, and the capacity."""

    def frame_refused(self, kind: str) -> None:
        """A push-stream frame was refused, for a reason in ``FRAME_KINDS``."""

    def refit_bytes(self, kind: str, nbytes: int) -> None:
        """A refit's bytes of one kind in ``BYTE_KINDS`` (reported once per prepared refit)."""


class PublishObserver(Protocol):
    def version_published(self, version: int, nbytes: int) -> None:
        """A version of ``nbytes`` was published by this rank."""

    def receivers_acked(self, done: int, registered: int) -> None:
        """``done`` of ``registered`` receivers are done with the last version."""

    def watch_served(self, served_bytes: Callable[[], int | None]) -> None:
        """Where to read the bytes peers have read from this rank (None: the transport can't tell)."""


class NullObserver:
    def stage_enter(self, stage: str) -> None:
        pass

    def stage_item(self, stage: str, nbytes: int, seconds: float) -> None:
        pass

    def transport_read(self, transport: str, nbytes: int, seconds: float) -> None:
        pass

    def queues(self, queues: Mapping[str, QueueStats]) -> None:
        pass

    def fence_state(self, state: str) -> None:
        pass

    def refit_outcome(self, outcome: str, version: int | None) -> None:
        pass

    def budget(self, used_bytes: int, peak_bytes: int, capacity_bytes: int) -> None:
        pass

    def frame_refused(self, kind: str) -> None:
        pass

    def refit_bytes(self, kind: str, nbytes: int) -> None:
        pass

    def version_published(self, version: int, nbytes: int) -> None:
        pass

    def receivers_acked(self, done: int, registered: int) -> None:
        pass

    def watch_served(self, served_bytes: Callable[[], int | None]) -> None:
        pass


NULL_OBSERVER = NullObserver()
