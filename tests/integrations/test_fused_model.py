"""Receiver layouts of a live fused model (vLLM names, padded vocabulary): the layout tables at the rank's
place, checked against the model's own parameters; no vLLM needed."""

from __future__ import annotations

import contextlib

import anyio
import pytest
import torch

import refitflow as rf
from refitflow.integrations.hosting.fused_model import derive, parameters
from refitflow.layouts import Parallel, fused, megatron
from refitflow.layouts.canonical import from_canonical
from refitflow.layouts.wire import layout_metadata
from refitflow.refit.destination import ApplyMode, Destination
from tests.integrations._fused_model import SENTINEL, FusedModel
from tests.integrations._tiny import canonical, config, dims
from tests.integrations._vllm_rank import expected, holds


def layout(kind: str, tp: int, rank: int) -> dict:
    return fused.layout_for(config(kind), fused.parallel(tp=tp, tp_rank=rank))


@pytest.mark.parametrize("kind", ["qwen2", "mixtral", "deepseek"])
def test_every_parameter_of_a_fused_model_maps_through_the_tables(kind: str) -> None:
    for rank in (0, 1):
        model = FusedModel(dims(kind), 2, rank)
        derived = derive(parameters(model), layout(kind, 2, rank))
        assert derived.complete, derived.why()
        assert set(derived.targets) == {n for n, _ in model.named_parameters()}


def test_a_padded_vocabulary_parameter_is_its_own_destination_and_its_padding_is_not_expected() -> None:
    model = FusedModel(dims("qwen2"), 2, 1)  # vocab 100 padded to 128: rank 1 holds rows 64..127, 28 of padding
    derived = derive(parameters(model), layout("qwen2", 2, 1))
    head = derived.layout["lm_head.weight"]
    assert head.shape == (64, 64) and len(head.segments) == 1
    assert head.segments[0].cbox == ((64, 100), (0, 64)) and head.segments[0].lbox == ((0, 36), (0, 64))
    assert derived.targets["lm_head.weight"].data_ptr() == model.param("lm_head.weight").data_ptr()
    expected_elements = Destination(derived.targets, ApplyMode.IN_PLACE, derived.layout).expected
    assert expected_elements["lm_head.weight"] == 36 * 64  # the padding rows are nobody's


def test_a_parameter_the_tables_lack_or_of_another_shape_is_unmapped_and_one_the_model_lacks_is_missing() -> None:
    d = dims("mixtral")
    model = FusedModel(d, 2, 0)
    o_proj = model.get_submodule("model.layers.0.self_attn.o_proj")
    o_proj.register_parameter("bias", torch.nn.Parameter(torch.zeros(64), requires_grad=False))  # no rule for it
    params = [(n, p[:1] if n == "model.layers.1.self_attn.o_proj.weight" else p) for n, p in parameters(model)]
    params = [(n, p) for n, p in params if n != "model.norm.weight"]
    derived = derive(params, layout("mixtral", 2, 0))
    assert derived.unmapped == {
        "model.layers.0.self_attn.o_proj.bias": "no entry in the layout tables",
        "model.layers.1.self_attn.o_proj.weight": "shape (1, 32), the layout says (64, 32)",
    }
    assert derived.missing == ["model.norm.weight"] and not derived.complete
    assert "model.norm.weight" in derived.why() and set(derived.layout) == set(derived.targets)
    w13 = derived.layout["model.layers.1.block_sparse_moe.experts.routed_experts.w13_weight"]
    assert w13.shape == (4, 32, 64) and {s.canonical for s in w13.segments} == {
        "model.layers.1.mlp.experts.gate", "model.layers.1.mlp.experts.up"}  # fmt: skip


@pytest.mark.asyncio
async def test_a_megatron_publication_refits_the_derived_layout_bit_exactly_without_touching_padding(registry) -> None:
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
                derived = derive(parameters(model), layout("qwen2", 2, r))
                async with rf.Receiver(derived.targets, registry, identity=ident, layout=derived.layout) as recv:
                    await recv.refit(1, timeout=10)
    for r, model in enumerate(models):
        assert holds(model, expected("qwen2", 1, 2, r))
    assert bool((models[1].param("model.embed_tokens.weight")[36:] == SENTINEL).all())
