"""A short seed of the soak (``bench/soak.py``): every fault of the matrix once, real processes, NIXL — the
registry in memory, and two replicas on a 3-member etcd cluster (there also a replica killed for good, twice).

Nothing hangs, no two ranks serve different versions, no commit differs from the bytes of the
version it names, no process is left behind, every version all ranks committed is released within a
lease or so; a flipped byte never commits, and the versions after a fault commit again.
"""

from __future__ import annotations

import json

import anyio
import pytest

from bench.soak import FAULTS, soak


@pytest.mark.asyncio
@pytest.mark.parametrize("kept_in", ["memory", "etcd"])  # the soak starts its own etcd (3 members, 2 replicas)
async def test_a_short_soak_with_every_fault_loses_nothing_and_splits_nothing(kept_in: str) -> None:
    plan = ["none", "byte_flip", "publisher_kill", "none", "publisher_stall", "receiver_kill", "none",
            "concurrent_refits", "registry_restart", "none"]  # fmt: skip
    assert set(plan) - {"none"} == set(FAULTS)
    if kept_in == "etcd":  # the replica every client uses, killed for good at a random moment
        plan[3] = plan[6] = "replica_kill"
    with anyio.fail_after(300):
        counts = await soak(15, len(plan), plan, store=kept_in)
    said = json.dumps(counts)  # whole, with each failed version's why (pytest shortens a dict)
    bad = ("hangs", "mixed", "corrupt", "leaked_processes", "release_stalls")
    assert all(counts[k] == 0 for k in bad) and not counts["crashes"], said
    outcomes = dict(o.split(":", 1) for o in counts["outcomes"])
    assert outcomes["2"] == "byte_flip:not", said  # the changed byte never commits
    assert all(outcomes[v].endswith("committed") for v in ("1", "4", "7", "10")), said  # after each fault
    if "registry_fd_growth" in counts:  # the first registry lived through the run (in memory)
        assert counts["registry_fd_growth"] <= 2 and counts["registry_rss_growth_mb"] < 50, said
