"""Coverage: every destination parameter written exactly once, checked at commit.

Buckets are credited whole (``credit``: arrays of parameter positions and element counts computed
with the plan), in O(1) Python per bucket; the sums are formed once, at ``check``, in numpy against the
destination's expected counts (``CoverageIndex``, made once per destination, with each plan's parameter
positions mapped into it once): O(1) Python per parameter only when a check fails.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping

import numpy as np

from refitflow.core.errors import CoverageError

__all__ = ["CoverageIndex", "CoverageTracker"]


class CoverageIndex:
    """A destination's parameters, in one order, with the elements each must receive; and each plan's
    parameter tuple mapped into that order (-1: not a parameter here), made once per tuple."""

    def __init__(self, expected: Mapping[str, int]) -> None:
        self.names = list(expected)
        self.at = {n: i for i, n in enumerate(self.names)}
        self.expected = np.fromiter(expected.values(), dtype=np.int64, count=len(self.names))
        self._positions: dict[int, tuple[tuple[str, ...], np.ndarray]] = {}  # id(params) -> (params kept alive, map)

    def positions(self, params: tuple[str, ...]) -> np.ndarray:
        found = self._positions.get(id(params))
        if found is None or found[0] is not params:
            if len(self._positions) > 64:  # plans come and go (a new layout, a rebind): keep the recent ones
                self._positions.clear()
            found = (params, np.fromiter((self.at.get(n, -1) for n in params), dtype=np.int64, count=len(params)))
            self._positions[id(params)] = found
        return found[1]


class CoverageTracker:
    """Counts the elements written into each destination parameter, region by region."""

    def __init__(self, expected: Mapping[str, int] | CoverageIndex) -> None:
        self._index = expected if isinstance(expected, CoverageIndex) else CoverageIndex(expected)
        self._recorded: dict[str, int] = {}
        self._regions: set[tuple[str, Hashable]] = set()
        self._duplicated: set[str] = set()
        self._credits: dict[Hashable, tuple[tuple[str, ...], np.ndarray, np.ndarray]] = {}

    def record(self, param: str, region: Hashable, numel: int) -> None:
        """Credit ``numel`` elements of ``param`` written at ``region`` (a key unique per box)."""
        key = (param, region)
        if key in self._regions or param not in self._index.at:
            self._duplicated.add(param)
            return
        self._regions.add(key)
        self._recorded[param] = self._recorded.get(param, 0) + numel

    def credit(self, key: Hashable, params: tuple[str, ...], idx: np.ndarray, counts: np.ndarray) -> None:
        """Credit ``counts[i]`` elements to ``params[idx[i]]`` for every i (one bucket, ``key`` unique)."""
        if key in self._credits:  # the same bucket twice: everything in it is written twice
            self._duplicated.update(params[i] for i in idx.tolist())
            return
        self._credits[key] = (params, idx, counts)

    def _written(self) -> np.ndarray:
        """Elements written per parameter (the index's order); credits to names not held count as duplicated."""
        index = self._index
        by_params: dict[int, tuple[tuple[str, ...], list[np.ndarray], list[np.ndarray]]] = {}
        for params, idx, counts in self._credits.values():
            entry = by_params.setdefault(id(params), (params, [], []))
            entry[1].append(idx)
            entry[2].append(counts)
        written = np.zeros(len(index.names), dtype=np.int64)
        for params, idx_parts, count_parts in by_params.values():
            idx = np.concatenate(idx_parts)
            pos, counts = index.positions(params)[idx], np.concatenate(count_parts).astype(np.int64)
            held = pos >= 0
            if not held.all():
                self._duplicated.update(params[i] for i in np.unique(idx[~held & (counts != 0)]).tolist())
            written += np.bincount(pos[held], weights=counts[held], minlength=len(index.names)).astype(np.int64)
        for name, n in self._recorded.items():
            written[index.at[name]] += n
        return written

    def check(self, *, version: int | None = None) -> None:
        """Raise ``CoverageError`` listing missing and doubly-written parameters."""
        written, index = self._written(), self._index
        wrong = np.flatnonzero(written != index.expected)
        if not len(wrong) and not self._duplicated:
            return
        duplicated = set(self._duplicated)
        missing = []
        for i in wrong.tolist():
            if written[i] > index.expected[i]:
                duplicated.add(index.names[i])
            else:
                missing.append(index.names[i])
        raise CoverageError(
            "not every parameter was written exactly once",
            missing=missing,
            duplicated=sorted(duplicated),
            version=version,
        )
