"""Coverage: every destination parameter written exactly once, checked at commit.

Buckets are credited whole (``credit``: arrays of parameter positions and element counts computed
with the plan), in O(1) Python per bucket; the sums are formed once, at ``check``.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping

import numpy as np

from refitflow.core.errors import CoverageError

__all__ = ["CoverageTracker"]


class CoverageTracker:
    """Counts the elements written into each destination parameter, region by region."""

    def __init__(self, expected: Mapping[str, int]) -> None:
        self._expected = dict(expected)
        self._written: dict[str, int] = dict.fromkeys(expected, 0)
        self._regions: set[tuple[str, Hashable]] = set()
        self._duplicated: set[str] = set()
        self._credits: dict[Hashable, tuple[tuple[str, ...], np.ndarray, np.ndarray]] = {}

    def record(self, param: str, region: Hashable, numel: int) -> None:
        """Credit ``numel`` elements of ``param`` written at ``region`` (a key unique per box)."""
        key = (param, region)
        if key in self._regions or param not in self._written:
            self._duplicated.add(param)
            return
        self._regions.add(key)
        self._written[param] += numel

    def credit(self, key: Hashable, params: tuple[str, ...], idx: np.ndarray, counts: np.ndarray) -> None:
        """Credit ``counts[i]`` elements to ``params[idx[i]]`` for every i (one bucket, ``key`` unique)."""
        if key in self._credits:  # the same bucket twice: everything in it is written twice
            self._duplicated.update(params[i] for i in idx.tolist())
            return
        self._credits[key] = (params, idx, counts)

    def _totals(self) -> None:
        by_params: dict[int, tuple[tuple[str, ...], list[np.ndarray], list[np.ndarray]]] = {}
        for params, idx, counts in self._credits.values():
            entry = by_params.setdefault(id(params), (params, [], []))
            entry[1].append(idx)
            entry[2].append(counts)
        self._credits.clear()
        for params, idx_parts, count_parts in by_params.values():
            sums = np.bincount(np.concatenate(idx_parts), weights=np.concatenate(count_parts), minlength=len(params))
            for name, n in zip(params, sums.astype(np.int64).tolist(), strict=True):
                if not n:
                    continue
                if name in self._written:
                    self._written[name] += n
                else:
                    self._duplicated.add(name)

    def check(self, *, version: int | None = None) -> None:
        """Raise ``CoverageError`` listing missing and doubly-written parameters."""
        self._totals()
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
