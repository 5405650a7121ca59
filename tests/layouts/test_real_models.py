"""Real transformers models: Megatron-sharded trainers refit fused inference ranks at another TP, bit-exactly."""

from __future__ import annotations

import contextlib

import anyio
import pytest
import torch
import transformers as tf

import refitflow as rf
from refitflow.layouts import Parallel, canonical_shapes, fused, hf, megatron
from refitflow.layouts.canonical import from_canonical, to_canonical
from refitflow.layouts.wire import layout_metadata

BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8)


def _model(kind: str, kv_heads: int, seed: int = 0, **config) -> torch.nn.Module:
    torch.manual_seed(seed)
    common = BASE | {"num_key_value_heads": kv_heads, "tie_word_embeddings": False} | config
    if kind == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**common))
    elif kind == "qwen2":
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**common))
    elif kind == "qwen3":
        model = tf.Qwen3ForCausalLM(tf.Qwen3Config(**common | {"head_dim": 8}))
    else:
        cfg = tf.MixtralConfig(**common | {"intermediate_size": 32, "num_local_experts": 4, "num_experts_per_tok": 2})
        model = tf.MixtralForCausalLM(cfg)
    return model.to(torch.bfloat16).eval()


async def _refit(
    trainer: torch.nn.Module,
    train: tuple[int, int],
    infer: tuple[int, int],
    tamper=None,
    fill: float = 0.0,
    train_options: dict | None = None,
    infer_options: dict | None = None,
    **options,
) -> tuple[list[dict[str, torch.Tensor]], list[dict], list[rf.RefitResult]]:
    """Publish the trainer Megatron-sharded at (tp, ep); refit fused ranks at (tp, ep); return them.

    ``tamper(shards)``: called with each trainer rank's published tensors after publishing.
    ``fill``: what the receivers' tensors hold before the refit; ``*_options``: the layouts' keywords.
    """
    train_options, infer_options = train_options or {}, infer_options or {}
    d = hf.dims_from_config(trainer.config)
    canon = to_canonical([(hf.layout(d), trainer.state_dict())], canonical_shapes(d))
    registry, ident = rf.Registry(), rf.Identity(model="tiny", layout="megatron")
    (ttp, tep), (itp, iep) = train, infer
    tpars = [Parallel(tp=ttp, tp_rank=r % ttp, ep=tep, ep_rank=r // ttp) for r in range(ttp * tep)]
    ipars = [Parallel(tp=itp, tp_rank=r % itp, ep=iep, ep_rank=r // itp) for r in range(itp * iep)]
    maps = [fused.layout(d, p, **infer_options) for p in ipars]
    ranks = [{n: torch.full(lt.shape, fill) for n, lt in m.items()} for m in maps]
    results = []
    async with contextlib.AsyncExitStack() as stack:
        for r, p in enumerate(tpars):
            meta = layout_metadata("megatron", d, p, **train_options)
            pub = await stack.enter_async_context(
                rf.Publisher(registry, identity=ident, rank=r, world_size=len(tpars), metadata=meta)
            )
            shards = from_canonical(megatron.layout(d, p, **train_options), canon)
            await pub.publish(1, shards)
            if tamper is not None:
                tamper(shards)
        for m, tensors in zip(maps, ranks, strict=True):
            async with rf.Receiver(tensors, registry, identity=ident, layout=m, **options) as recv:
                results.append(await recv.refit(1, timeout=10))
    return ranks, [dict(m) for m in maps], results


def _logits(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.arange(32).reshape(2, 16) % 128
    with torch.no_grad():
        return model(input_ids=ids).logits


CASES = [
    ("llama", 2, (2, 1), (4, 1)),
    ("llama", 4, (4, 1), (1, 1)),
    ("llama", 2, (1, 1), (2, 1)),
    ("qwen2", 2, (2, 1), (4, 1)),
    ("qwen3", 2, (2, 1), (1, 1)),
    ("mixtral", 2, (1, 2), (2, 1)),
    ("mixtral", 2, (2, 2), (1, 2)),
]


@pytest.mark.asyncio
@pytest.mark.parametrize(("kind", "kv", "train", "infer"), CASES)
async def test_megatron_trainer_refits_fused_ranks_bit_exactly(kind: str, kv: int, train, infer) -> None:
    trainer = _model(kind, kv)
    with anyio.fail_after(30):
        ranks, maps, results = await _refit(trainer, train, infer)
    d = hf.dims_from_config(trainer.config)
    canon = to_canonical(list(zip(maps, ranks, strict=True)), canonical_shapes(d))
    fresh = _model(kind, kv, seed=1).float()
    assert not torch.equal(_logits(fresh), _logits(trainer.float()))
    fresh.load_state_dict(from_canonical(hf.layout(d), canon), strict=True)
    assert torch.equal(_logits(fresh), _logits(trainer.float()))
    assert all(r.unverified_bytes == 0 for r in results)  # verify="strict": every pulled block checked


@pytest.mark.asyncio
@pytest.mark.parametrize(("kind", "kv", "train", "infer"), [CASES[0], CASES[4]])
async def test_each_inference_rank_pulls_exactly_its_slice(kind: str, kv: int, train, infer) -> None:
    trainer = _model(kind, kv)
    with anyio.fail_after(30):
        ranks, _, results = await _refit(trainer, train, infer, verify="pulled")
    for tensors, result in zip(ranks, results, strict=True):
        ideal = sum(t.numel() for t in tensors.values()) * 2  # bf16 source bytes of this rank's slice
        assert result.nbytes == result.ideal_bytes == ideal
