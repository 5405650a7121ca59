"""A trainer whose parameters are views of one buffer, laid out last first as Megatron's DDP buffers are:
the publisher registers the buffer once and announces each tensor at its offset; a receiver whose
parameter holds a layer's experts in order reads each run of neighbouring experts as one read, runs
downwards (real NIXL transfers, a real Qwen3-MoE-shaped model)."""

from __future__ import annotations

import contextlib
import itertools

import anyio
import pytest
import torch

import refitflow as rf
from refitflow.layouts import Parallel, canonical_shapes, fused, hf
from refitflow.layouts.canonical import from_canonical, to_canonical
from refitflow.layouts.wire import LAYOUTS, layout_metadata
from tests.layouts._models import _model, assert_same_logits

TRAIN = [Parallel(ep=2, ep_rank=r) for r in range(2)]
INFER = [fused.parallel(tp=2, tp_rank=r, expert_parallel=True) for r in range(2)]
OPTIONS = {"experts": "grouped"}


def _ddp_buffer(shards: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same tensors as views of one buffer holding them in reverse order (Megatron iterates its
    parameters backwards when it lays out a DDP buffer)."""
    names = list(shards)[::-1]
    buffer = torch.empty(sum(shards[n].numel() for n in names), dtype=torch.bfloat16)
    out, at = {}, 0
    for n in names:
        view = buffer[at : at + shards[n].numel()].view(shards[n].shape)
        view.copy_(shards[n])
        out[n], at = view, at + view.numel()
    return {n: out[n] for n in shards}


async def _refit(trainer: torch.nn.Module, packed: bool) -> tuple[list, list, list, list]:
    d = hf.dims_from_config(trainer.config)
    canon = to_canonical([(hf.layout(d), trainer.state_dict())], canonical_shapes(d))
    registry, ident = rf.Registry(), rf.Identity(model="tiny", layout="megatron")
    maps = [fused.layout(d, p) for p in INFER]
    ranks = [{n: torch.zeros(lt.shape, dtype=torch.bfloat16) for n, lt in m.items()} for m in maps]
    manifests, plans = [], []
    async with contextlib.AsyncExitStack() as stack:
        for r, p in enumerate(TRAIN):
            meta = layout_metadata("megatron", d, p, **OPTIONS)
            pub = await stack.enter_async_context(rf.Publisher(
                registry, identity=ident, rank=r, world_size=len(TRAIN), metadata=meta, transport="nixl"))  # fmt: skip
            shards = {n: t.clone() for n, t in from_canonical(LAYOUTS["megatron"](d, p, **OPTIONS), canon).items()}
            manifests.append(await pub.publish(1, _ddp_buffer(shards) if packed else shards))
        for m, tensors in zip(maps, ranks, strict=True):
            async with rf.Receiver(tensors, registry, identity=ident, layout=m, transport="nixl") as recv:
                result = await recv.refit(1, timeout=30)
                assert result.direct_bytes > 0
                plans.append(recv._plans.plans()[-1])
    return ranks, [dict(m) for m in maps], manifests, [r for plan in plans for b in plan.buckets for r in b.reads]


@pytest.mark.asyncio
async def test_experts_of_a_reversed_ddp_buffer_are_read_a_run_at_a_time_downwards() -> None:
    trainer = _model("qwen3_moe")
    with anyio.fail_after(120):
        apart = await _refit(trainer, False)
        ranks, maps, manifests, reads = await _refit(trainer, True)
    assert_same_logits(trainer, "qwen3_moe", maps, ranks)
    assert all(torch.equal(a, b) for x, y in zip(apart[0], ranks, strict=True) for a, b in zip(
        x.values(), y.values(), strict=True))  # fmt: skip
    for m in manifests:  # one region per rank: the buffer, each tensor at its own offset, last first
        assert len({s.region for s in m.shards}) == 1
        ends = sorted((s.offset, s.offset + s.nbytes) for s in m.shards)
        assert ends[0][0] == 0 and all(a[1] == b[0] for a, b in itertools.pairwise(ends))
        assert m.shards[0].offset == ends[-1][0]
    downwards = [r for r in reads if r.stride < 0]
    # each layer's 4 experts per trainer rank, gate_up and down: one read each, in the receiver's order
    assert downwards and all(r.count == 4 for r in downwards)
    assert len(reads) < len(apart[3]) - 2 * len(downwards)
