"""verify's hashing of many small units: the same digests as one call each, hashed in groups with the GIL
let go between them (python-xxhash keeps the GIL while it hashes an input under ~100 KB, and one C loop
over a bucket of 1,250 small units kept it for all of them: the event loop's thread waited up to 15 ms)."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash

from refitflow.refit import hashes as verify


def test_grouped_hashes_equal_one_call_per_unit_and_the_gil_is_let_go_between_groups(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    data = np.random.default_rng(0).integers(0, 256, 1000 * 4096 + 13, dtype=np.uint8)
    mv = memoryview(data)
    views = [mv[i * 4096 : (i + 1) * 4096 + (i % 3)] for i in range(1000)]
    calls = [0]
    monkeypatch.setattr(verify, "let_go", lambda: calls.__setitem__(0, calls[0] + 1))
    got = verify._hash_views(views)
    assert np.array_equal(got, np.array([xxhash.xxh3_64_intdigest(v) for v in views], dtype=np.uint64))
    assert calls[0] == -(-len(views) // verify._HASH_GROUP)  # once after every group
    calls[0] = 0
    assert np.array_equal(verify._hash_views(views[:5]), got[:5]) and calls[0] == 0  # one group: no pause
