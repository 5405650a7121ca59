"""A version's digest vector gathered from its manifests' digest blobs (``planner.vector.DigestRuns``) equals the
one decoded shard by shard, for whole and tiled digests across ranks; a publication that does not fit the runs
is refused typed; a manifest carries its digests decoded as it is made, or as its record carried them."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import refitflow as rf
from refitflow.core.records import RankLayout, materialise, record_of
from refitflow.planner.checks import DigestIndex
from refitflow.planner.vector import DigestRuns, digest_vector
from tests.core.test_records import _spec

ID = rf.Identity(model="vector")


def manifest(version: int, rank: int, n: int = 12) -> rf.Manifest:
    """Whole (one digest) and tiled (several) shards, interleaved."""
    shards = tuple(_spec(i + 100 * rank, (128, 256) if i % 3 else (64,), bool(i % 3), version) for i in range(n))
    return rf.Manifest(identity=ID, version=version, rank=rank, world_size=2, shards=shards,
                       source=rf.SourceAddress(transport="loopback", agent=f"t{rank}"))  # fmt: skip


def publication(version: int, n: int = 12) -> rf.Publication:
    return rf.Publication(identity=ID, version=version, manifests=(manifest(version, 0, n), manifest(version, 1, n)))


def index_of(pub: rf.Publication, picks: list[tuple[int, int]]) -> DigestIndex:
    index = DigestIndex(pub)
    for s, p in picks:
        index.place(s, pub.manifests[s].shards[p].name)
    index.seal()
    return index


PICKS = [(1, 5), (0, 0), (0, 7), (1, 4), (0, 3), (1, 0), (0, 11)]  # across both ranks, out of shard order


def test_the_gathered_vector_equals_the_one_decoded_shard_by_shard_version_after_version() -> None:
    index = index_of(publication(1), PICKS)
    runs = index.runs
    assert isinstance(runs, DigestRuns) and runs.count == index.count and runs.sources == (0, 1)
    for version in (1, 2, 3):
        pub = publication(version)
        want = digest_vector(pub, index.order, index.count)  # shard by shard
        got = digest_vector(pub, index.order, index.count, runs=runs)
        assert got.dtype == np.uint64 and np.array_equal(got, want)
        # and each shard's digests where the index put them
        for s, p in PICKS:
            spec = pub.manifests[s].shards[p]
            _, at = index[(s, spec.name)]
            assert np.array_equal(got[at : at + spec.tiling.count], spec.digest_array())


def test_whole_tensor_digests_alone_gather_one_per_shard() -> None:
    picks = [(0, p) for p in (6, 0, 3, 9)] + [(1, 3)]  # i % 3 == 0: one digest each
    index = index_of(publication(1), picks)
    assert index.count == len(picks)
    pub = publication(4)
    assert np.array_equal(digest_vector(pub, index.order, index.count, runs=index.runs),
                          digest_vector(pub, index.order, index.count))  # fmt: skip


def test_a_publication_that_does_not_fit_the_runs_is_refused_typed() -> None:
    index = index_of(publication(1), PICKS)
    longer = publication(2, n=13)  # a shard more at each rank's end: the blobs are longer
    with pytest.raises(rf.ManifestError, match="do not fit its layout digest"):
        digest_vector(longer, index.order, index.count, placed=False, runs=index.runs)
    one_rank = dataclasses.replace(publication(2), manifests=(manifest(2, 0),))
    with pytest.raises(rf.ManifestError, match="not where, or not what"):
        digest_vector(one_rank, index.order, index.count, placed=False, runs=index.runs)
    with pytest.raises(rf.ManifestError, match="not where, or not what"):  # the placement check, when asked
        digest_vector(longer, [*index.order[:1], (0, 1, index.order[0][2])], index.count, runs=index.runs)


def test_a_manifest_carries_its_digests_decoded_once_or_as_its_record_carried_them() -> None:
    m = manifest(3, 0)
    assert m.digest_blob == b"".join(s.digest_bytes for s in m.shards)
    assert "digest_blob" in vars(m)  # decoded as it was made
    layout = RankLayout.of_checked(m)
    record = record_of(m, layout.id)
    assert bytes(record.digests) == m.digest_blob
    again = materialise(layout, record)
    assert again.digest_blob == m.digest_blob and again == m
    pending = dataclasses.replace(m, shards=tuple(dataclasses.replace(s, digest="", blocks="") for s in m.shards),
                                  revision="")  # fmt: skip
    assert "digest_blob" not in vars(pending)
    with pytest.raises(rf.ManifestError, match="pending"):
        pending.digest_blob  # noqa: B018
