"""When a published version is *released*: its publisher may change or free its tensors.

``ReleasePolicy()`` (the default) waits for every registered receiver to report the version.
``ReleasePolicy(receivers=n)`` waits for at least ``n`` receivers instead (useful when receivers
come and go); ``ReleasePolicy(after_s=t)`` also releases ``t`` seconds after the version was
complete, whatever the receivers did (a receiver still reading it then may fail its integrity
check and abort, never commit wrong bytes). Both may be combined: whichever comes first.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from refitflow.core.errors import ConfigError

__all__ = ["ReleasePolicy"]


@dataclass(frozen=True, kw_only=True)
class ReleasePolicy:
    receivers: int | None = None  # None: all registered receivers; n: at least n of them
    after_s: float | None = None  # released this many seconds after the version became complete

    def __post_init__(self) -> None:
        if self.receivers is not None and (isinstance(self.receivers, bool) or self.receivers < 1):
            raise ConfigError(f"release_policy.receivers must be a positive integer or None, got {self.receivers!r}")
        if self.after_s is not None and not self.after_s >= 0:
            raise ConfigError(f"release_policy.after_s must be ≥ 0 seconds or None, got {self.after_s!r}")

    def released(self, done: Collection[int], version: int, age_s: float | None, *, all_known: bool = True) -> bool:
        """``done``: each receiver's highest version done with; ``age_s``: seconds since complete.

        ``all_known`` False: receivers may be missing from ``done`` (a restarted registry they have not
        re-registered with yet), so "every receiver" cannot be judged; a count or a time still can.
        """
        if self.after_s is not None and age_s is not None and age_s >= self.after_s:
            return True
        finished = sum(1 for d in done if d >= version)
        if self.receivers is None:
            return all_known and finished == len(done)
        return finished >= self.receivers

    def to_dict(self) -> dict[str, Any]:
        return {"receivers": self.receivers, "after_s": self.after_s}

    @classmethod
    def from_dict(cls, d: Any) -> ReleasePolicy:
        if d is None:
            return cls()
        if not isinstance(d, dict) or set(d) - {"receivers", "after_s"}:
            raise ConfigError(f"malformed release policy {d!r:.80}")
        receivers, after_s = d.get("receivers"), d.get("after_s")
        if receivers is not None and not isinstance(receivers, int):
            raise ConfigError(f"release_policy.receivers must be an integer, got {receivers!r:.40}")
        if after_s is not None and (isinstance(after_s, bool) or not isinstance(after_s, int | float)):
            raise ConfigError(f"release_policy.after_s must be a number, got {after_s!r:.40}")
        return cls(receivers=receivers, after_s=after_s)
