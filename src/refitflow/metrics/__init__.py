"""Metrics seam: stages and the pipeline report through the small ``Observer`` Protocol.

The Prometheus implementation comes with the observability work; ``NULL_OBSERVER`` ignores
everything, and tests pass their own observers (also to inject failures at a chosen stage).
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["NULL_OBSERVER", "NullObserver", "Observer"]


class Observer(Protocol):
    def stage_item(self, stage: str, nbytes: int, seconds: float) -> None:
        """One item left ``stage`` after ``seconds`` of work, carrying ``nbytes``."""

    def fence_state(self, state: str) -> None:
        """The fence moved to ``state``."""

    def refit_outcome(self, outcome: str, version: int | None) -> None:
        """A refit ended: ``committed``, ``aborted`` or ``refused``."""

    def budget(self, used_bytes: int, peak_bytes: int, capacity_bytes: int) -> None:
        """Staging bytes held now, at peak, and the capacity."""


class NullObserver:
    def stage_item(self, stage: str, nbytes: int, seconds: float) -> None:
        pass

    def fence_state(self, state: str) -> None:
        pass

    def refit_outcome(self, outcome: str, version: int | None) -> None:
        pass

    def budget(self, used_bytes: int, peak_bytes: int, capacity_bytes: int) -> None:
        pass


NULL_OBSERVER = NullObserver()
