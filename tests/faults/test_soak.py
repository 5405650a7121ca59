"""A short seed of the soak (``bench/soak.py``): every fault of the matrix once, real processes, NIXL.

Nothing hangs, no two ranks serve different versions, no commit differs from the bytes of the
version it names, no process is left behind; a flipped byte never commits, and the versions after a
fault commit again.
"""

from __future__ import annotations

import anyio
import pytest

from bench.soak import FAULTS, soak


@pytest.mark.asyncio
async def test_a_short_soak_with_every_fault_loses_nothing_and_splits_nothing() -> None:
    plan = ["none", "byte_flip", "publisher_kill", "none", "publisher_stall", "receiver_kill", "none",
            "concurrent_refits", "registry_restart", "none"]  # fmt: skip
    assert set(plan) - {"none"} == set(FAULTS)
    with anyio.fail_after(240):
        counts = await soak(15, len(plan), plan)
    assert counts["hangs"] == counts["mixed"] == counts["corrupt"] == counts["leaked_processes"] == 0, counts
    outcomes = dict(o.split(":", 1) for o in counts["outcomes"])
    assert outcomes["2"] == "byte_flip:not", counts  # the changed byte never commits
    assert all(outcomes[v].endswith("committed") for v in ("1", "4", "7", "10")), counts  # after each fault
    assert counts["registry_fd_growth"] <= 2 and counts["registry_rss_growth_mb"] < 50, counts
