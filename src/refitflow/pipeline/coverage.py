"""Coverage: every destination parameter written exactly once, checked at commit."""

from __future__ import annotations

from collections.abc import Hashable, Mapping

from refitflow.core.errors import CoverageError

__all__ = ["CoverageTracker"]


class CoverageTracker:
    """Counts the elements written into each destination parameter, region by region."""

    def __init__(self, expected: Mapping[str, int]) -> None:
        self._expected = dict(expected)
        self._written: dict[str, int] = dict.fromkeys(expected, 0)
        self._regions: set[tuple[str, Hashable]] = set()
        self._duplicated: set[str] = set()

    def record(self, param: str, region: Hashable, numel: int) -> None:
        """Credit ``numel`` elements of ``param`` written at ``region`` (a key unique per box)."""
        key = (param, region)
        if key in self._regions or param not in self._written:
            self._duplicated.add(param)
            return
        self._regions.add(key)
        self._written[param] += numel

    def check(self, *, version: int | None = None) -> None:
        """Raise ``CoverageError`` listing missing and doubly-written parameters."""
        duplicated = set(self._duplicated)
        missing = []
        for name, numel in self._expected.items():
            written = self._written[name]
            if written > numel:
                duplicated.add(name)
            elif written < numel:
                missing.append(name)
        if missing or duplicated:
            raise CoverageError(
                "not every parameter was written exactly once",
                missing=missing,
                duplicated=sorted(duplicated),
                version=version,
            )
