"""Multi-source slice planning: the issue's worked examples, gaps, overlaps, strided columns, blocks."""

from __future__ import annotations

import base64

import pytest
import torch

import refitflow as rf
from refitflow.core.types import shard_tiling
from refitflow.layouts.canonical import sliced
from refitflow.planner import PlannedRead, build_plan
from refitflow.planner.compile_filter import check_compile
from refitflow.planner.reads import coalesce
from refitflow.refit.config import ReceiverConfig
from refitflow.refit.destination import ApplyMode, Destination

SHAPE = (4096, 1024)
ROW = 1024 * 2  # bf16 bytes per row


def _spec(start: int, stop: int, **kw) -> rf.ShardSpec:
    return rf.ShardSpec(
        name="w", dtype="bfloat16", global_shape=SHAPE, axis=0, start=start, stop=stop, digest="0" * 16, region=0, **kw
    )


def _pub(*ranges: tuple[int, int], **kw) -> rf.Publication:
    ident = rf.Identity(model="m")
    manifests = tuple(
        rf.Manifest(
            identity=ident,
            version=1,
            rank=r,
            world_size=len(ranges),
            source=rf.SourceAddress(transport="loopback", agent=f"a{r}"),
            shards=(_spec(a, b, **kw),),
        )
        for r, (a, b) in enumerate(ranges)
    )
    return rf.Publication(identity=ident, version=1, manifests=manifests)


def _plan(pub: rf.Publication, axis: int, start: int, stop: int, **cfg):
    local = sliced("w", SHAPE, axis, start, stop)
    dest = Destination({"w": torch.zeros(local.shape, dtype=torch.bfloat16)}, ApplyMode.IN_PLACE, {"w": local})
    limits = ReceiverConfig(**({"verify": "pulled"} | cfg)).limits
    return build_plan(pub, dest, limits)


def _reads(plan) -> list[tuple[int, int, int]]:
    """(source, first row, row after) of each read, sorted (a plan starts at its rank's place: its order may
    begin anywhere, ``test_replica_place.py``)."""
    return sorted((r.source, r.src_offset // ROW, (r.src_offset + r.nbytes) // ROW)
                  for b in plan.buckets for r in b.reads)  # fmt: skip


def test_tp8_rank1_reads_rows_512_to_1024_from_rank0_only() -> None:
    plan = _plan(_pub((0, 2048), (2048, 4096)), 0, 512, 1024)
    assert _reads(plan) == [(0, 512, 1024)]
    assert plan.nbytes == plan.ideal_bytes == 512 * ROW
    assert all(p.direct for b in plan.buckets for p in b.pieces)  # contiguous both sides, same dtype: no staging


def test_range_1500_2500_stitches_two_sources() -> None:
    plan = _plan(_pub((0, 2048), (2048, 4096)), 0, 1500, 2500)
    assert _reads(plan) == [(0, 1500, 2048), (1, 0, 452)]  # rank 1's shard rows [0, 452)
    assert plan.nbytes == 1000 * ROW


def test_one_publisher_holding_rows_0_1024_is_a_gap() -> None:
    with pytest.raises(rf.PlanError, match=r"coverage gap in w axis 0 \[1024, 4096\)"):
        _plan(_pub((0, 1024)), 0, 0, 4096)


def test_a_gap_outside_the_receivers_slice_does_not_matter() -> None:
    assert _reads(_plan(_pub((0, 1024)), 0, 0, 512)) == [(0, 0, 512)]


def test_overlapping_shards_are_a_plan_error() -> None:
    with pytest.raises(rf.PlanError, match=r"overlapping shards on axis 0 at \[1000, 2048\)"):
        _plan(_pub((0, 2048), (1000, 4096)), 0, 0, 4096)


def test_an_overlap_among_hundreds_of_disjoint_shards_is_found() -> None:
    # 256 shards of 16 rows (like one stacked tensor's per-expert boxes), and one straddling two of them
    ranges = [(16 * k, 16 * k + 16) for k in range(256)]
    with pytest.raises(rf.PlanError, match=r"overlapping shards on axis 0 at \[1000, 1008\)"):
        _plan(_pub(*ranges, (1000, 1100)), 0, 0, 4096)
    with pytest.raises(rf.PlanError, match=r"overlapping shards on axis 0 at \[4000, 4001\)"):
        _plan(_pub((0, 4001), *ranges[250:]), 0, 0, 4096)  # a long early shard meets a late one
    assert _plan(_pub(*ranges), 0, 0, 4096).ideal_bytes == 4096 * ROW


def test_column_slice_reads_only_its_columns_as_strided_reads() -> None:
    plan = _plan(_pub((0, 2048), (2048, 4096)), 1, 256, 512, max_strided_runs=1000, descriptor_bytes=0)
    reads = [r for b in plan.buckets for r in b.reads]
    assert plan.nbytes == plan.ideal_bytes == 4096 * 256 * 2
    # one run per row and nothing more, described as a few strided reads (a row apart)
    assert all(r.nbytes == 256 * 2 and r.stride == ROW for r in reads) and sum(r.count for r in reads) == 4096
    # pieces of at most 1,000 runs (what verify checks at a time), read as one strided read per shard
    assert max(p.count for b in plan.buckets for p in b.pieces) <= 1000
    assert [r.count for r in reads] == [2048, 2048]


@pytest.mark.parametrize("verify", ["pulled", "strict"])
def test_a_column_slice_reads_whole_rows_when_they_cost_fewer_bytes_than_the_descriptors_they_save(
    verify: str,
) -> None:
    """512-byte runs a 2,048-byte row apart: 1,536 bytes more a descriptor saved. Under ``descriptor_bytes`` of
    2 KiB (and the default 32 KiB) the whole rows, a few contiguous reads; under 1 KiB the strided runs."""
    count = shard_tiling("xxh3", (2048, 1024), 2, 64, 256).count
    tiles = {"tile_rows": 64, "tile_cols": 256, "blocks": base64.b64encode(bytes(8 * count)).decode()}
    pub = _pub((0, 2048), (2048, 4096), **(tiles if verify == "strict" else {}))  # strict: slices of whole tiles
    for worth in (2048, ReceiverConfig().descriptor_bytes):
        plan = _plan(pub, 1, 256, 512, verify=verify, descriptor_bytes=worth)
        reads = [r for b in plan.buckets for r in b.reads]
        assert plan.nbytes == 4096 * ROW and plan.ideal_bytes == 4096 * 256 * 2
        assert sum(r.count for r in reads) <= 4096 * ROW // plan.buckets[0].nbytes + 2
        assert not any(p.direct for b in plan.buckets for p in b.pieces)  # the slice is copied out of staging
    plan = _plan(pub, 1, 256, 512, verify=verify, descriptor_bytes=1024)
    assert plan.nbytes == plan.ideal_bytes and sum(r.count for b in plan.buckets for r in b.reads) == 4096


def test_whole_rows_are_read_at_most_max_row_factor_times_a_slices_bytes() -> None:
    """64 of 1,024 columns: whole rows would be 16× the slice — every reader of the shard would take 16 copies
    from its source — so the slice is read as strided runs unless ``max_row_factor`` allows 16."""
    pub = _pub((0, 2048), (2048, 4096))
    narrow = _plan(pub, 1, 256, 320)
    assert narrow.nbytes == narrow.ideal_bytes == 4096 * 64 * 2
    wide = _plan(pub, 1, 256, 320, max_row_factor=16)
    assert wide.nbytes == 4096 * ROW and sum(r.count for b in wide.buckets for r in b.reads) < 20


def test_short_strided_runs_read_the_enclosing_rows() -> None:
    plan = _plan(_pub((0, 2048), (2048, 4096)), 1, 0, 8, min_run_bytes=64)  # 16-byte runs
    assert plan.nbytes == 4096 * ROW and plan.ideal_bytes == 4096 * 8 * 2
    assert len([r for b in plan.buckets for r in b.reads]) <= 4096 * ROW // plan.buckets[0].nbytes + 2


def test_strict_verify_widens_unaligned_cuts_to_whole_blocks() -> None:
    blocks = base64.b64encode(bytes(8 * 32)).decode()  # 32 blocks of 64 rows per shard
    plan = _plan(
        _pub((0, 2048), (2048, 4096), tile_rows=64, tile_cols=1024, blocks=blocks), 0, 1500, 2500, verify="strict"
    )
    assert _reads(plan) == [(0, 1472, 2048), (1, 0, 512)]
    assert plan.ideal_bytes == 1000 * ROW
    # without block digests a shard is one block: strict reads both shards whole
    assert _reads(_plan(_pub((0, 2048), (2048, 4096)), 0, 1500, 2500, verify="strict")) == [(0, 0, 2048), (1, 0, 2048)]


def test_compile_filter_rejects_other_targets() -> None:
    pub = _pub((0, 4096))
    with pytest.raises(rf.PlanError, match="compile target 'hf_raw'"):
        check_compile(pub, ReceiverConfig(compile_targets=("vllm_fused",)).limits)
    with pytest.raises(rf.PlanError, match=r"compile metadata differs on \['quant'\]"):
        check_compile(pub, ReceiverConfig(compile_metadata={"quant": "fp8"}).limits)
    check_compile(pub, ReceiverConfig(compile_targets=("hf_raw",)).limits)


def test_replicated_tensors_are_read_once_spread_across_sources() -> None:
    ident = rf.Identity(model="m")
    names = [f"t{i}" for i in range(4)]

    def spec(n: str) -> rf.ShardSpec:
        return rf.ShardSpec(
            name=n, dtype="float32", global_shape=(8,), axis=None, start=0, stop=8, digest="0" * 16, region=0
        )

    manifests = tuple(
        rf.Manifest(
            identity=ident,
            version=1,
            rank=r,
            world_size=2,
            source=rf.SourceAddress(transport="loopback", agent=f"a{r}"),
            shards=tuple(spec(n) for n in names),
        )
        for r in range(2)
    )
    dest = Destination({n: torch.zeros(8) for n in names}, ApplyMode.IN_PLACE)
    plan = build_plan(rf.Publication(identity=ident, version=1, manifests=manifests), dest, ReceiverConfig().limits)
    pieces = [p for b in plan.buckets for p in b.pieces]
    assert sorted(p.tensor for p in pieces) == names  # each once
    assert {p.source for p in pieces} == {0, 1}  # from both sources


def test_every_gap_and_an_axis_mismatch_are_reported() -> None:
    ident = rf.Identity(model="m")

    def manifest(r: int, *specs: rf.ShardSpec) -> rf.Manifest:
        src = rf.SourceAddress(transport="loopback", agent=f"a{r}")
        return rf.Manifest(identity=ident, version=1, rank=r, world_size=2, source=src, shards=specs)

    def spec(name: str, axis: int, start: int, stop: int) -> rf.ShardSpec:
        return rf.ShardSpec(
            name=name,
            dtype="float32",
            global_shape=(8, 8),
            axis=axis,
            start=start,
            stop=stop,
            digest="0" * 16,
            region=0,
        )

    dest = Destination({"a": torch.zeros(8, 8), "b": torch.zeros(8, 8)}, ApplyMode.IN_PLACE)
    limits = ReceiverConfig().limits
    gaps = (manifest(0, spec("a", 0, 0, 2), spec("b", 1, 0, 4)), manifest(1, spec("a", 0, 4, 8)))
    with pytest.raises(rf.PlanError, match=r"gap in a axis 0 \[2, 4\); coverage gap in b axis 1 \[4, 8\)"):
        build_plan(rf.Publication(identity=ident, version=1, manifests=gaps), dest, limits)
    mixed = (manifest(0, spec("a", 0, 0, 4), spec("b", 0, 0, 8)), manifest(1, spec("a", 1, 4, 8)))
    with pytest.raises(rf.PlanError, match="axis mismatch: shards of a split on axis 1 and axis 0"):
        build_plan(rf.Publication(identity=ident, version=1, manifests=mixed), dest, limits)


def test_the_last_direct_buckets_taper_so_the_last_verification_is_short() -> None:
    ident = rf.Identity(model="m")
    names = [f"t{i}" for i in range(40)]  # 40 tensors of 8 MiB, all landing directly
    specs = tuple(
        rf.ShardSpec(name=n, dtype="float32", global_shape=(2048, 1024), axis=None, start=0, stop=2048,
                     digest="0" * 16, region=i)
        for i, n in enumerate(names)
    )  # fmt: skip
    manifest = rf.Manifest(identity=ident, version=1, rank=0, world_size=1, shards=specs,
                           source=rf.SourceAddress(transport="loopback", agent="a"))  # fmt: skip
    dest = Destination({n: torch.empty(2048, 1024, device="meta") for n in names}, ApplyMode.IN_PLACE)
    plan = build_plan(rf.Publication(identity=ident, version=1, manifests=(manifest,)), dest, ReceiverConfig().limits)
    sizes = [b.nbytes >> 20 for b in plan.buckets]
    assert sum(sizes) == 320 and max(sizes) <= 64 and sizes[-1] <= 16  # MiB: the taper's floor
    assert sizes == sorted(sizes, reverse=True) and len(sizes) <= 10


def test_reads_landing_back_to_back_merge_where_their_sources_keep_one_step() -> None:
    def read(src: int, n: int, at: int, param: str | None = "w") -> PlannedRead:
        return PlannedRead(0, 3, src, n, param, at)

    # neighbouring tensors of a buffer laid out last first: one read, runs downwards
    down = coalesce([read(300, 100, 0), read(200, 100, 100), read(100, 100, 200), read(0, 100, 300)])
    assert down == [PlannedRead(0, 3, 300, 100, "w", 0, stride=-100, count=4)]
    # back to back in both places: one run; a constant gap: strided
    assert coalesce([read(0, 100, 0), read(100, 100, 100)]) == [read(0, 200, 0)]
    assert coalesce([read(0, 100, 0), read(150, 100, 100), read(300, 100, 200)]) == [
        PlannedRead(0, 3, 0, 100, "w", 0, stride=150, count=3)
    ]
    # another step, size, region, landing or overlapping runs: a read of its own
    assert len(coalesce([read(300, 100, 0), read(200, 100, 100), read(50, 100, 200)])) == 2
    assert len(coalesce([read(300, 100, 0), read(200, 50, 100)])) == 2
    assert len(coalesce([read(300, 100, 0), read(200, 100, 100, param=None)])) == 2
    assert len(coalesce([read(300, 100, 0), read(200, 100, 150)])) == 2
    assert len(coalesce([read(100, 100, 0), read(150, 100, 100)])) == 2
