"""StreamReceiver on a real gloo group inside one process (sender and receivers are tasks of one loop,
each rank its own group connections): mapping, casts, FP8, tied names, alignment, budget, metrics."""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from prometheus_client import CollectorRegistry

import refitflow as rf
from refitflow.layouts import Parallel, canonical_shapes, fused, hf
from refitflow.layouts.canonical import from_canonical, to_canonical
from refitflow.metrics.prometheus import PrometheusMetrics
from tests.layouts._fp8 import dequantize
from tests.push._frames import server, weights
from tests.push._inproc import groups, together


def _same(model: torch.nn.Module | dict, expected: dict[str, torch.Tensor]) -> bool:
    got = dict(model.named_parameters()) if isinstance(model, torch.nn.Module) else model
    return all(torch.equal(got[n].detach(), t) for n, t in expected.items())


@pytest.mark.asyncio
async def test_an_older_stream_is_refused_and_drained_and_the_next_one_commits() -> None:
    g0, g1 = await groups(2)
    sender, model = rf.StreamSender(g0, bucket_bytes=4096), server(1)
    recv = rf.StreamReceiver(model, g1, mode="shadow", budget_bytes=1 << 20)
    _, refused = await together(lambda: sender.send(3, weights(3)), lambda: recv.refit(min_version=5))
    assert isinstance(refused, rf.VersionError) and "older than the 5 asked for" in str(refused)
    assert recv.ledger.last_begun is None and not _same(model, weights(3))
    _, result = await together(lambda: sender.send(6, weights(6)), lambda: recv.refit(min_version=5))
    assert isinstance(result, rf.RefitResult) and result.version == 6 and _same(model, weights(6))


@pytest.mark.asyncio
async def test_an_unknown_name_is_refused_before_anything_is_written_and_counted() -> None:
    g0, g1 = await groups(2)
    metrics = PrometheusMetrics(CollectorRegistry())
    model = server(1)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    recv = rf.StreamReceiver(model, g1, budget_bytes=1 << 20, observer=metrics)
    extra = {"3.weight": torch.ones(4)} | weights(1)  # in the first bucket, with names the model has
    _, err = await together(lambda: rf.StreamSender(g0, bucket_bytes=4096).send(1, extra), recv.refit)
    assert isinstance(err, rf.PlanError) and err.tensor == "3.weight" and "no parameter named '3.weight'" in str(err)
    assert _same(model, before) and recv.fence.state.value == "ready" and recv.status.first_failure
    sample = metrics.registry.get_sample_value
    assert sample("refitflow_stream_frames_refused_total", {"kind": "mapping"}) == 1
    assert sample("refitflow_refits_total", {"outcome": "aborted"}) == 1
    assert sample("refitflow_stage_items_total", {"stage": "pull"}) == 2  # both buckets received (in step)
    assert sample("refitflow_stage_items_total", {"stage": "apply"}) == 0  # neither applied


@pytest.mark.asyncio
async def test_a_lossy_cast_is_refused_unless_asked_for() -> None:
    g0, g1, g2 = await groups(3)
    strict = rf.StreamReceiver(server(1).to(torch.bfloat16), g1, budget_bytes=1 << 20)
    lossy = rf.StreamReceiver(server(2).to(torch.bfloat16), g2, budget_bytes=1 << 20, lossy_casts=True)
    _, refused, result = await together(
        lambda: rf.StreamSender(g0, bucket_bytes=4096).send(1, weights(1)), strict.refit, lossy.refit
    )
    assert isinstance(refused, rf.PlanError) and "lossy_casts is off" in str(refused)
    assert isinstance(result, rf.RefitResult) and strict.ledger.committed_version is None
    expected = {n: t.to(torch.bfloat16) for n, t in weights(1).items()}
    assert _same(lossy.destination.params, expected)


@pytest.mark.asyncio
async def test_a_float8_destination_is_quantised_once_complete_and_its_scale_credited() -> None:
    g0, g1 = await groups(2)
    w = torch.randn(256, 200, dtype=torch.bfloat16)
    params = {
        "w": torch.zeros(256, 200, dtype=torch.float8_e4m3fn),
        "w_scale_inv": torch.zeros(2, 2, dtype=torch.float32),
        "b": torch.zeros(8, dtype=torch.bfloat16),
    }
    recv = rf.StreamReceiver(params, g1, budget_bytes=1 << 20)
    tensors = {"w": w, "b": torch.ones(8, dtype=torch.bfloat16)}
    _, result = await together(lambda: rf.StreamSender(g0, bucket_bytes=4096).send(1, tensors), recv.refit)
    assert isinstance(result, rf.RefitResult), result
    back = dequantize(params["w"], params["w_scale_inv"])
    assert torch.allclose(back, w.float(), rtol=0.07, atol=1e-3) and params["w_scale_inv"].min() > 0
    assert torch.equal(params["b"], tensors["b"])


@pytest.mark.asyncio
async def test_float8_values_sent_on_the_stream_are_refused_not_requantised_without_their_scales() -> None:
    g0, g1 = await groups(2)
    params = {"w": torch.zeros(128, 128, dtype=torch.float8_e4m3fn), "w_scale_inv": torch.ones(1, 1)}
    recv = rf.StreamReceiver(params, g1, budget_bytes=1 << 20)
    sent = {"w": torch.full((128, 128), 2.0).to(torch.float8_e4m3fn), "w_scale_inv": torch.full((1, 1), 0.5)}
    _, err = await together(lambda: rf.StreamSender(g0, bucket_bytes=4096).send(1, sent), recv.refit)
    assert isinstance(err, rf.PlanError) and "unquantised tensors only" in str(err) and err.tensor == "w"
    assert not params["w"].float().any() and recv.ledger.committed_version is None


@pytest.mark.asyncio
async def test_a_tied_tensor_sent_under_both_names_is_written_once() -> None:
    g0, g1 = await groups(2)
    model = torch.nn.ModuleDict({"emb": torch.nn.Embedding(16, 8), "head": torch.nn.Linear(8, 16, bias=False)})
    model["head"].weight = model["emb"].weight  # tied: one tensor, two names
    trainer = {"emb.weight": torch.randn(16, 8), "head.weight": None}
    trainer["head.weight"] = trainer["emb.weight"]  # a state dict lists the tied tensor under both names
    recv = rf.StreamReceiver(model, g1, mode="shadow", budget_bytes=1 << 20)
    _, result = await together(lambda: rf.StreamSender(g0, bucket_bytes=64).send(1, trainer), recv.refit)
    assert isinstance(result, rf.RefitResult), result
    assert torch.equal(model["head"].weight, trainer["emb.weight"]) and model["head"].weight is model["emb"].weight


@pytest.mark.asyncio
async def test_an_entry_packed_at_an_unaligned_offset_lands_bit_exact() -> None:
    g0, g1 = await groups(2)
    tensors = {"mask": torch.tensor([True, False, True]), "w": torch.randn(5, 3, dtype=torch.bfloat16)}
    params = {"mask": torch.zeros(3, dtype=torch.bool), "w": torch.zeros(5, 3, dtype=torch.float32)}
    recv = rf.StreamReceiver(params, g1, budget_bytes=1 << 20)  # bf16 at byte 3, cast to fp32 on the way
    _, result = await together(lambda: rf.StreamSender(g0).send(1, tensors), recv.refit)
    assert isinstance(result, rf.RefitResult), result
    assert torch.equal(params["mask"], tensors["mask"]) and torch.equal(params["w"], tensors["w"].float())


@pytest.mark.asyncio
async def test_one_bucket_is_resident_at_a_time_within_the_budget() -> None:
    g0, g1 = await groups(2)
    tensors = {f"t{i}": torch.randn(1000 + i) for i in range(12)}  # ~4 KB each, 48 KB in all
    budget = 12_000
    recv = rf.StreamReceiver(dict((n, torch.zeros_like(t)) for n, t in tensors.items()), g1, budget_bytes=budget)
    sent, result = await together(lambda: rf.StreamSender(g0, bucket_bytes=8192).send(1, tensors), recv.refit)
    assert isinstance(result, rf.RefitResult), result
    largest = max(sum(tensors[f"t{i}"].nbytes for i in r) for r in _ranges(tensors, 8192))
    assert sent.buckets > 3 and result.peak_staging_bytes == largest < budget < result.nbytes
    assert recv.budget.statistics().used_bytes == 0 and result.stages["pull"].items == sent.buckets


def _ranges(tensors: dict[str, torch.Tensor], limit: int) -> list[range]:
    from refitflow.push.format import bucket_ranges

    return bucket_ranges([t.nbytes for t in tensors.values()], limit)


@pytest.mark.asyncio
async def test_a_payload_larger_than_the_budget_leaves_the_group_and_nobody_waits() -> None:
    g0, g1 = await groups(2, timeout_s=30)
    recv = rf.StreamReceiver(server(1), g1, budget_bytes=1024)  # the first bucket is 2336 bytes
    sent, err = await together(lambda: rf.StreamSender(g0, bucket_bytes=4096).send(1, weights(1)), recv.refit)
    assert isinstance(err, rf.OutOfStepError) and "at most" in str(err) and g1.closed
    assert isinstance(sent, rf.OutOfStepError) and g0.closed  # its next broadcast found the receiver gone
    assert recv.status.in_progress is False and recv.ledger.last_begun is None  # refused at the first header


@pytest.mark.asyncio
async def test_hf_expert_names_land_in_fused_experts_across_expert_parallel_ranks() -> None:
    torch.manual_seed(0)
    cfg = tf.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                           num_experts_per_tok=2, tie_word_embeddings=False)  # fmt: skip
    trainer = tf.MixtralForCausalLM(cfg).to(torch.bfloat16)
    d = hf.dims_from_config(cfg)
    state = trainer.state_dict()
    canonical = to_canonical([(hf.layout(d), state)], canonical_shapes(d))
    maps = [fused.layout(d, Parallel(ep=2, ep_rank=r)) for r in range(2)]
    ranks = [{n: torch.zeros(lt.shape, dtype=torch.bfloat16) for n, lt in m.items()} for m in maps]
    g = await groups(3)
    recvs = [
        rf.StreamReceiver(t, g[i + 1], layout=m, source_layout=hf.layout(d), budget_bytes=1 << 20)
        for i, (t, m) in enumerate(zip(ranks, maps, strict=True))
    ]
    sender = rf.StreamSender(g[0], bucket_bytes=8192)
    results = await together(lambda: sender.send(1, state), recvs[0].refit, recvs[1].refit)
    assert all(isinstance(r, rf.RefitResult) for r in results[1:]), results
    for m, tensors in zip(maps, ranks, strict=True):
        assert _same(tensors, from_canonical(m, canonical))
    assert results[1].ideal_bytes < results[1].nbytes  # each rank needs only its experts of what it received
