"""Receiver layouts derived from a live fused model (vLLM/SGLang names, padded vocabulary); no vLLM needed."""

from __future__ import annotations

import contextlib

import anyio
import pytest
import torch

import refitflow as rf
from refitflow.integrations.fused_model import derive, parameters, vocab_rows
from refitflow.layouts import Parallel, megatron
from refitflow.layouts.canonical import from_canonical
from refitflow.layouts.wire import layout_metadata
from tests.integrations._fused_model import SENTINEL, FusedModel
from tests.integrations._tiny import canonical, dims
from tests.integrations._vllm_rank import expected, holds


def test_vocabulary_rows_follow_the_padded_split() -> None:
    assert vocab_rows(100, 64, 0) == (0, 64) and vocab_rows(100, 64, 1) == (64, 100)  # 28 rows of padding
    assert vocab_rows(10, 16, 1) == (10, 10)  # a rank holding only padding writes nothing


def test_padded_vocabulary_parameters_map_only_their_real_rows_onto_the_live_storage() -> None:
    model = FusedModel(dims("qwen2"), 2, 1)
    derived = derive(parameters(model), dims("qwen2"), Parallel(tp=2, tp_rank=1))
    assert derived.complete and derived.padded == {"model.embed_tokens.weight": 28, "lm_head.weight": 28}
    head = derived.layout["lm_head.weight"]
    assert head.shape == (36, 64) and head.segments[0].cbox == ((64, 100), (0, 64))
    assert derived.targets["lm_head.weight"].data_ptr() == model.param("lm_head.weight").data_ptr()
    assert set(derived.targets) == {n for n, _ in model.named_parameters()}


def test_mixtral_module_names_and_experts_map_and_a_stranger_does_not() -> None:
    d = dims("mixtral")
    model = FusedModel(d, 2, 0)
    o_proj = model.get_submodule("model.layers.0.self_attn.o_proj")
    o_proj.register_parameter("bias", torch.nn.Parameter(torch.zeros(64), requires_grad=False))  # no rule for it
    derived = derive(parameters(model), d, Parallel(tp=2, tp_rank=0))
    assert derived.unmapped == ["model.layers.0.self_attn.o_proj.bias"] and not derived.complete
    w13 = derived.layout["model.layers.1.block_sparse_moe.experts.w13_weight"]
    assert w13.shape == (4, 32, 64) and {s.canonical for s in w13.segments} == {
        "model.layers.1.mlp.experts.gate", "model.layers.1.mlp.experts.up"}  # fmt: skip


def test_a_parameter_of_another_shape_is_unmapped() -> None:
    d = dims("qwen2")
    model = FusedModel(d, 2, 0)
    wrong = [(n, p[:1] if n.endswith("o_proj.weight") else p) for n, p in model.named_parameters()]
    assert len(derive(wrong, d, Parallel(tp=2, tp_rank=0)).unmapped) == d.layers


@pytest.mark.asyncio
async def test_a_megatron_publication_refits_the_derived_layout_bit_exactly(registry) -> None:
    d = dims("qwen2")
    ident = rf.Identity(model="tiny", layout="megatron")
    canon = canonical("qwen2", 1)
    models = [FusedModel(d, 2, r) for r in (0, 1)]
    with anyio.fail_after(30):
        async with contextlib.AsyncExitStack() as stack:
            for r in (0, 1):  # trainer at TP 2
                p = Parallel(tp=2, tp_rank=r)
                pub = await stack.enter_async_context(
                    rf.Publisher(
                        registry, identity=ident, rank=r, world_size=2, metadata=layout_metadata("megatron", d, p)
                    )
                )
                await pub.publish(1, from_canonical(megatron.layout(d, p), canon))
            for r, model in enumerate(models):
                derived = derive(parameters(model), d, Parallel(tp=2, tp_rank=r))
                async with rf.Receiver(derived.targets, registry, identity=ident, layout=derived.layout) as recv:
                    await recv.refit(1, timeout=10)
    for r, model in enumerate(models):
        assert holds(model, expected("qwen2", 1, 2, r))
    assert bool((models[1].param("model.embed_tokens.weight")[36:] == SENTINEL).all())
