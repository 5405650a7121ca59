"""Descriptor arithmetic of the NIXL transport (pure numpy, no NIXL)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import refitflow as rf
from refitflow.transports._nixl_descs import LocalIndex, RegionInfo, coalesce, pack_address, stripe, unpack_address


def u64(*xs: int) -> np.ndarray:
    return np.array(xs, dtype=np.uint64)


def test_coalesce_merges_only_ranges_continuing_on_both_sides_in_one_region_pair() -> None:
    laddr, raddr, n = u64(0, 10, 20, 30, 40), u64(100, 110, 125, 135, 145), u64(10, 10, 10, 10, 10)
    lkey, rkey = np.array([0, 0, 0, 0, 1]), np.array([5, 5, 5, 5, 5])
    la, ra, nb, first = coalesce(laddr, raddr, n, lkey, rkey)
    assert la.tolist() == [0, 20, 40] and ra.tolist() == [100, 125, 145] and nb.tolist() == [20, 20, 10]
    assert first.tolist() == [0, 2, 4]


def test_local_index_finds_regions_even_when_registrations_overlap() -> None:
    index = LocalIndex({0: RegionInfo(1000, 100, 0, "DRAM"), 1: RegionInfo(1050, 10, 0, "DRAM")})
    pos = index.locate(u64(1000, 1090, 1052), u64(100, 10, 5))
    assert [index.infos[p].addr for p in pos] == [1000, 1000, 1050]
    with pytest.raises(rf.TransportError, match="not inside registered memory"):
        index.locate(u64(1095), u64(10))


def test_address_round_trips_and_malformed_ones_are_transport_errors() -> None:
    table = {3: RegionInfo(4096, 10, 0, "DRAM"), 7: RegionInfo(1 << 47, 1 << 30, 1, "VRAM")}
    assert unpack_address(pack_address(table, b"md")) == (table, b"md")
    for bad in (b"", b"junk", pack_address(table, b"md")[:20], pack_address(table, b"")):
        with pytest.raises(rf.TransportError):
            unpack_address(bad)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_stripe_cuts_ranges_into_equal_parts_covering_every_byte_once(k: int) -> None:
    sizes = [5 << 20, 3 << 20, 9 << 20, 1]
    larr = np.array([[a, s, 0] for a, s in zip(np.cumsum([0, *sizes[:-1]]), sizes, strict=True)], dtype=np.uint64)
    rarr = larr.copy()
    rarr[:, 0] += 1 << 40
    parts = stripe(larr, rarr, k, min_bytes=1 << 20)
    assert len(parts) == k
    total = sum(sizes)
    got = sorted((int(a), int(n)) for la, _ in parts for a, n, _ in la)
    assert got[0][0] == 0 and all(a + n == b for (a, n), (b, _) in itertools.pairwise(got))
    assert sum(n for _, n in got) == total
    for la, ra in parts:
        assert (ra[:, 0] - la[:, 0] == 1 << 40).all() and (ra[:, 1] == la[:, 1]).all()
        assert abs(int(la[:, 1].sum()) - total / k) <= 4096 + 1
    assert len(stripe(larr, rarr, 4, min_bytes=1 << 30)) == 1  # too small to be worth striping
