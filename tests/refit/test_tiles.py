"""2-D digest tiles end to end: exact re-sharding with every byte verified, flipped bytes caught anywhere,
1-D tensors in budget-sized pieces, and per-bucket checks computed once with the plan."""

from __future__ import annotations

import contextlib

import anyio
import pytest
import torch

import refitflow as rf
from bench.tp_matrix import publication, rank_plan, rank_target
from refitflow.layouts import ModelDims, Parallel, canonical_shapes, fused, megatron
from refitflow.layouts.canonical import from_canonical
from refitflow.layouts.wire import layout_metadata
from refitflow.planner.build import build_plan
from refitflow.planner.records import Plan
from refitflow.refit.config import ReceiverConfig
from refitflow.refit.destination import ApplyMode, Destination

# wide enough that row-parallel weights get 8 column ranges (>= 256 bytes each), small enough for a test
DIMS = ModelDims(vocab=512, hidden=1024, layers=1, heads=8, kv_heads=8, head_dim=128, ffn=2048)
DOWN = "decoder.layers.0.mlp.linear_fc2.weight"  # row-parallel: receivers of another TP read column slices
QKV = "decoder.layers.0.self_attention.linear_qkv.weight"


@pytest.mark.parametrize("m", [1, 2, 4, 8])
@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_strict_resharding_pulls_at_most_1_1x_each_slice_and_verifies_every_byte(m: int, n: int) -> None:
    """With whole rows never read instead of column slices (``descriptor_bytes=0``): the slices alone."""
    pub = publication(DIMS, m)
    for rank in range(n):
        plan = rank_plan(pub, rank_target(DIMS, n, rank), "strict", descriptor_bytes=0)
        assert plan.nbytes <= 1.1 * plan.ideal_bytes, (m, n, rank, plan.nbytes / plan.ideal_bytes)
        # every pulled byte lies in a digest unit the rank holds whole (nothing left to trust)
        assert sum(b.checks.whole_bytes for b in plan.buckets) == plan.nbytes
        assert sum(len(b.reads) for b in plan.buckets) <= 200  # strided reads: one per slice piece, not per row


def _descriptors(plan: Plan) -> int:
    return sum(r.count for b in plan.buckets for r in b.reads)


@pytest.mark.parametrize("m", [1, 2, 4, 8])
@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_whole_rows_are_read_where_they_cost_fewer_bytes_than_the_descriptors_they_save(m: int, n: int) -> None:
    """By default a column slice is read as its whole rows when they add fewer bytes than ``descriptor_bytes``
    for each read descriptor they save; every pulled byte is still verified whole."""
    pub, worth = publication(DIMS, m), ReceiverConfig().descriptor_bytes
    for rank in range(n):
        exact = rank_plan(pub, rank_target(DIMS, n, rank), "strict", descriptor_bytes=0)
        rows = rank_plan(pub, rank_target(DIMS, n, rank), "strict")
        saved = _descriptors(exact) - _descriptors(rows)
        assert saved >= 0 and rows.nbytes - exact.nbytes <= saved * worth, (m, n, rank, saved)
        assert sum(b.checks.whole_bytes for b in rows.buckets) == rows.nbytes
        if n > m:  # row-parallel weights sliced finer than the trainer's: a descriptor per row before
            assert _descriptors(rows) * 8 <= _descriptors(exact), (m, n, rank, _descriptors(rows), _descriptors(exact))


async def _refit(
    train_tp: int, infer_tp: int, rank: int, *, algo: str = "auto", mode: str = "in_place", tamper=None, **config
) -> tuple[dict[str, torch.Tensor], rf.RefitResult | BaseException, rf.Receiver, dict[str, torch.Tensor]]:
    """Publish DIMS Megatron-sharded at ``train_tp``; refit fused rank ``rank`` of ``infer_tp``."""
    torch.manual_seed(0)
    canon = {k: torch.randn(s).to(torch.bfloat16) for k, s in canonical_shapes(DIMS).items()}
    registry, ident = rf.Registry(), rf.Identity(model="tiles", layout="megatron")
    lay = fused.layout(DIMS, Parallel(tp=infer_tp, tp_rank=rank))
    tensors = {k: torch.zeros(lt.shape, dtype=torch.bfloat16) for k, lt in lay.items()}
    before = {k: t.clone() for k, t in tensors.items()}
    async with contextlib.AsyncExitStack() as stack:
        for r in range(train_tp):
            par = Parallel(tp=train_tp, tp_rank=r)
            pub = await stack.enter_async_context(
                rf.Publisher(registry, identity=ident, rank=r, world_size=train_tp, digest=algo,
                             metadata=layout_metadata("megatron", DIMS, par))
            )  # fmt: skip
            shards = from_canonical(megatron.layout(DIMS, par), canon)
            await pub.publish(1, shards)
            if tamper is not None:
                tamper(r, shards)
        recv = await stack.enter_async_context(
            rf.Receiver(tensors, registry, identity=ident, layout=lay, mode=mode, budget_bytes=1 << 20, **config)
        )
        try:
            result: rf.RefitResult | BaseException = await recv.refit(1, timeout=30)
        except rf.RefitError as exc:
            result = exc
    return tensors, result, recv, before


def _expected_local(infer_tp: int, rank: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    canon = {k: torch.randn(s).to(torch.bfloat16) for k, s in canonical_shapes(DIMS).items()}
    return from_canonical(fused.layout(DIMS, Parallel(tp=infer_tp, tp_rank=rank)), canon)


@pytest.mark.asyncio
@pytest.mark.parametrize("algo", ["xxh3", "mix64"])
@pytest.mark.parametrize("rows", [False, True])
async def test_a_tp2_trainer_refits_a_tp4_rank_bit_exactly_reading_its_slice(algo: str, rows: bool) -> None:
    """Its column slices alone (``descriptor_bytes=0``), or — the default — their whole rows where that costs
    fewer bytes than the descriptors it saves (the slices copied out of staging): bit-exact either way."""
    with anyio.fail_after(60):
        tensors, result, recv, _ = await _refit(2, 4, 1, algo=algo, **({} if rows else {"descriptor_bytes": 0}))
    assert isinstance(result, rf.RefitResult), result
    assert result.unverified_bytes == 0
    assert result.nbytes > 1.1 * result.ideal_bytes if rows else result.nbytes <= 1.1 * result.ideal_bytes
    want = _expected_local(4, 1)
    assert all(torch.equal(tensors[k], want[k]) for k in want)
    assert recv.fence.state == "ready"


def _flip(tensor: str, row: int, col: int):
    def tamper(rank: int, shards: dict[str, torch.Tensor]) -> None:
        if rank == 0:
            shards[tensor].view(torch.int16)[row, col] ^= 1 << 3  # after the digests: changed bytes in flight

    return tamper


@pytest.mark.asyncio
@pytest.mark.parametrize("algo", ["xxh3", "mix64"])
@pytest.mark.parametrize("mode", ["in_place", "shadow"])
@pytest.mark.parametrize(
    ("tensor", "row", "col", "infer_tp"),
    [
        (DOWN, 100, 300, 4),  # inside a tile of a column slice (rank 0 of TP4 reads columns 0-511 of rank 0's shard)
        (DOWN, 1023, 511, 4),  # the slice's last element
        (QKV, 5, 7, 2),  # a row slice read directly into the parameter
        (QKV, 1000, 1023, 1),  # whole rows (TP2 -> TP1): row digests
    ],
)
async def test_a_flipped_byte_anywhere_is_an_integrity_error(
    algo: str, mode: str, tensor: str, row: int, col: int, infer_tp: int
) -> None:
    with anyio.fail_after(60):
        tensors, result, recv, before = await _refit(
            2, infer_tp, 0, algo=algo, mode=mode, tamper=_flip(tensor, row, col)
        )
    assert isinstance(result, rf.IntegrityError), result
    assert result.tensor == tensor and "1 digest block(s) of 1 tensor(s)" in str(result)
    if mode == "shadow":
        assert recv.fence.state == "ready" and all(torch.equal(tensors[k], before[k]) for k in before)
    else:
        assert recv.fence.state == "fenced"


def test_a_1d_tensor_is_cut_into_budget_sized_pieces_not_elements() -> None:
    n = 1 << 20  # 2 MiB of bf16 into fp32: staged, so pieces are at most a bucket (64 KiB)
    spec = rf.ShardSpec(name="v", dtype="bfloat16", global_shape=(n,), axis=None, start=0, stop=n,
                        digest="0" * 16, region=0)  # fmt: skip
    ident = rf.Identity(model="m")
    pub = rf.Publication(identity=ident, version=1, manifests=(rf.Manifest(
        identity=ident, version=1, rank=0, world_size=1, source=rf.SourceAddress(transport="loopback", agent="a"),
        shards=(spec,),
    ),))  # fmt: skip
    dest = Destination({"v": torch.zeros(n)}, ApplyMode.IN_PLACE)
    limits = ReceiverConfig(budget_bytes=128 << 10, verify="pulled").limits
    plan = build_plan(pub, dest, limits)
    pieces = [p for b in plan.buckets for p in b.pieces]
    assert len(pieces) == 2 * n // limits.bucket_bytes  # 32 pieces of 32 Ki elements, not 1,024 of 1,024
    assert all(p.count == 1 for p in pieces) and plan.nbytes == 2 * n


@pytest.mark.asyncio
@pytest.mark.parametrize("algo", ["xxh3", "mix64"])
async def test_a_1d_tile_bigger_than_a_bucket_is_verified_across_buckets(ident, registry, algo: str) -> None:
    torch.manual_seed(1)
    src = {"big": torch.randn(3 << 20).to(torch.bfloat16), "small": torch.randn(100).to(torch.bfloat16)}
    dst = {k: torch.zeros(v.shape) for k, v in src.items()}
    with anyio.fail_after(60):
        async with (
            rf.Publisher(registry, identity=ident, digest=algo) as pub,
            rf.Receiver(dst, registry, identity=ident, budget_bytes=256 << 10) as recv,
        ):
            await pub.publish(1, src)
            result = await recv.refit(1)
            src["big"][(3 << 20) - 5] += 1  # the last tile, seen only when its last piece arrives
            await pub.publish(2, src)
            src["big"][(3 << 20) - 5] -= 1  # changed after the digest
            with pytest.raises(rf.IntegrityError, match="'big' \\(1 block\\)"):
                await recv.refit(2)
    assert result.unverified_bytes == 0 and result.stages["pull"].items > 20
    assert recv.fence.state == "fenced"


@pytest.mark.asyncio
async def test_a_replayed_plan_reuses_its_checks_and_credits(ident, registry) -> None:
    src = {f"t{i}": torch.randn(64 + i) for i in range(300)}
    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    with anyio.fail_after(60):
        async with (
            rf.Publisher(registry, identity=ident) as pub,
            rf.Receiver(dst, registry, identity=ident) as recv,
        ):
            await pub.publish(1, src)
            await recv.refit(1)
            plan, replay = next(iter(recv._plans._plans.values()))
            views = dict(replay.views)
            assert all(b.is_built for b in plan.buckets)  # made as the first refit handed them on
            made = [b.made[0] for b in plan.buckets]
            for v in src.values():
                v.add_(1)  # the same storages: the same layout, the plan replays
            await pub.publish(2, src)
            second = await recv.refit(2)
    assert second.plan_cached and next(iter(recv._plans._plans.values()))[0] is plan
    assert all(replay.views[k] is v for k, v in views.items())  # the same memoryviews, not rebuilt
    assert all(b.made == [m] for b, m in zip(plan.buckets, made, strict=True))  # the same checks, made once
    units = sum(len(b.checks.want) for b in plan.buckets)
    credited = sum(int(b.credits.counts.sum()) for b in plan.buckets)
    assert units == len(src) and credited == sum(v.numel() for v in src.values())
    assert all(torch.equal(dst[k], v) for k, v in src.items())
