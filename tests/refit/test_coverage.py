"""The coverage check at commit: every parameter written exactly once, in numpy against an index made once."""

from __future__ import annotations

import numpy as np
import pytest

from refitflow.core.errors import CoverageError
from refitflow.refit.coverage import CoverageIndex, CoverageTracker

EXPECTED = {"a": 10, "b": 20, "c": 5, "d": 0}
PARAMS = ("c", "a", "b")  # a plan's parameter tuple: its own order


def _bucket(idx: list[int], counts: list[int]) -> tuple[np.ndarray, np.ndarray]:
    return np.array(idx, dtype=np.int64), np.array(counts, dtype=np.int64)


def _error(t: CoverageTracker) -> CoverageError:
    with pytest.raises(CoverageError) as info:
        t.check(version=3)
    return info.value


def test_buckets_that_write_every_element_once_pass_and_split_parameters_add_up() -> None:
    index = CoverageIndex(EXPECTED)
    for _ in range(2):  # a second transaction reuses the index and the plan's positions
        t = CoverageTracker(index)
        t.credit((0, 0), PARAMS, *_bucket([1, 2], [10, 7]))
        t.credit((0, 1), PARAMS, *_bucket([2, 0], [13, 5]))
        t.check(version=3)


def test_a_missing_bucket_names_the_parameters_it_left_short() -> None:
    t = CoverageTracker(EXPECTED)
    t.credit((0, 0), PARAMS, *_bucket([1, 2], [10, 7]))
    err = _error(t)
    assert err.missing == ["b", "c"] and err.duplicated == []


def test_a_bucket_credited_twice_or_an_overlap_is_named_duplicated() -> None:
    t = CoverageTracker(EXPECTED)
    t.credit((0, 0), PARAMS, *_bucket([1, 2, 0], [10, 20, 5]))
    t.credit((0, 0), PARAMS, *_bucket([1], [10]))
    assert _error(t).duplicated == ["a"]
    t = CoverageTracker(EXPECTED)
    t.credit((0, 0), PARAMS, *_bucket([1, 2, 0], [10, 20, 5]))
    t.credit((0, 1), PARAMS, *_bucket([2], [1]))
    err = _error(t)
    assert err.duplicated == ["b"] and err.missing == []


def test_a_credit_to_a_parameter_not_held_is_duplicated_unless_it_is_empty() -> None:
    t = CoverageTracker(EXPECTED)
    t.credit((0, 0), ("a", "b", "c", "ghost", "empty"), *_bucket([0, 1, 2, 3, 4], [10, 20, 5, 4, 0]))
    err = _error(t)
    assert err.duplicated == ["ghost"] and err.missing == []


def test_boxes_recorded_one_by_one_count_once_per_region() -> None:
    t = CoverageTracker(EXPECTED)
    t.credit((0, 0), PARAMS, *_bucket([1, 2], [10, 20]))
    t.record("c", (0, 3), 3)
    t.record("c", (3, 5), 2)
    t.check()
    t.record("c", (3, 5), 2)  # the same box again
    t.record("nope", "x", 1)
    assert _error(t).duplicated == ["c", "nope"]
