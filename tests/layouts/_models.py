"""Tiny random transformers models, and a refit of one through real Publishers and Receivers (loopback)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import transformers as tf

import refitflow as rf
from refitflow.layouts import Parallel, canonical_shapes, hf
from refitflow.layouts.canonical import from_canonical, to_canonical
from refitflow.layouts.wire import LAYOUTS, layout_metadata

BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8)
# DeepSeek-V3 / Kimi-K2 shaped: latent attention, a dense first layer, then experts with a shared expert
DEEPSEEK = dict(
    vocab_size=200, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=8, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
    q_lora_rank=48, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_group=2, topk_group=1,
)  # fmt: skip
QWEN3_MOE = dict(vocab_size=200, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, head_dim=8)
Place = tuple[int, int] | list[Parallel]


def _model(kind: str, kv_heads: int = 2, seed: int = 0, **config) -> torch.nn.Module:
    """A tiny random bf16 model: llama, qwen2, qwen3, mixtral, qwen3_moe, deepseek_v3, deepseek_v2 (no q LoRA)."""
    torch.manual_seed(seed)
    common = BASE | {"num_key_value_heads": kv_heads, "tie_word_embeddings": False}
    if kind == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**common | config))
    elif kind == "qwen2":
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**common | config))
    elif kind == "qwen3":
        model = tf.Qwen3ForCausalLM(tf.Qwen3Config(**common | {"head_dim": 8} | config))
    elif kind == "qwen3_moe":
        model = tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(**common | QWEN3_MOE | config))
    elif kind == "deepseek_v3":
        model = tf.DeepseekV3ForCausalLM(tf.DeepseekV3Config(**DEEPSEEK | {"tie_word_embeddings": False} | config))
    elif kind == "deepseek_v2":
        v2 = DEEPSEEK | {"q_lora_rank": None, "n_group": 1, "topk_group": 1, "tie_word_embeddings": False}
        model = tf.DeepseekV2ForCausalLM(tf.DeepseekV2Config(**v2 | config))
    else:
        mixtral = {"intermediate_size": 32, "num_local_experts": 4, "num_experts_per_tok": 2}
        model = tf.MixtralForCausalLM(tf.MixtralConfig(**common | mixtral | config))
    for name, buf in model.named_buffers():
        if name.endswith("e_score_correction_bias"):  # zeros at init: make it matter for the routing
            buf.normal_(0, 0.5)
    return model.to(torch.bfloat16).eval()


def places(p: Place) -> list[Parallel]:
    """(tp, ep) → one Parallel per rank (TP fastest), or the ranks as given."""
    if isinstance(p, list):
        return p
    tp, ep = p
    return [Parallel(tp=tp, tp_rank=r % tp, ep=ep, ep_rank=r // tp) for r in range(tp * ep)]


async def _refit(
    trainer: torch.nn.Module,
    train: Place,
    infer: Place,
    tamper: Callable[[dict[str, torch.Tensor]], None] | None = None,
    fill: float = 0.0,
    train_options: dict | None = None,
    infer_options: dict | None = None,
    receiver: str = "fused",
    **options,
) -> tuple[list[dict[str, torch.Tensor]], list[dict], list[rf.RefitResult]]:
    """Publish the trainer Megatron-sharded at ``train``; refit ``receiver``-layout ranks at ``infer``.

    ``tamper(shards)``: called with each trainer rank's published tensors after publishing.
    ``fill``: what the receivers' tensors hold before the refit; ``*_options``: the layouts' keywords.
    """
    train_options, infer_options = train_options or {}, infer_options or {}
    d = hf.dims_from_config(trainer.config)
    canon = to_canonical([(hf.layout(d), trainer.state_dict())], canonical_shapes(d))
    registry, ident = rf.Registry(), rf.Identity(model="tiny", layout="megatron")
    tpars, ipars = places(train), places(infer)
    maps = [LAYOUTS[receiver](d, p, **infer_options) for p in ipars]
    ranks = [{n: torch.full(lt.shape, fill) for n, lt in m.items()} for m in maps]
    results = []
    async with contextlib.AsyncExitStack() as stack:
        for r, p in enumerate(tpars):
            meta = layout_metadata("megatron", d, p, **train_options)
            pub = await stack.enter_async_context(
                rf.Publisher(registry, identity=ident, rank=r, world_size=len(tpars), metadata=meta)
            )
            shards = from_canonical(LAYOUTS["megatron"](d, p, **train_options), canon)
            await pub.publish(1, shards)
            if tamper is not None:
                tamper(shards)
        for m, tensors in zip(maps, ranks, strict=True):
            async with rf.Receiver(tensors, registry, identity=ident, layout=m, **options) as recv:
                results.append(await recv.refit(1, timeout=20))
    return ranks, [dict(m) for m in maps], results


def _logits(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.arange(32).reshape(2, 16) % 128
    with torch.no_grad():
        return model(input_ids=ids).logits


def assert_same_logits(trainer: torch.nn.Module, kind: str, maps: list[dict], ranks: list[dict], **config) -> None:
    """Reassemble the receivers' tensors into a fresh model of another seed: its logits equal the trainer's."""
    d = hf.dims_from_config(trainer.config)
    canon = to_canonical(list(zip(maps, ranks, strict=True)), canonical_shapes(d))
    fresh = _model(kind, seed=1, **config).float()
    want = _logits(trainer.float())
    assert not torch.equal(_logits(fresh), want)
    fresh.load_state_dict(from_canonical(hf.layout(d), canon), strict=True)
    assert torch.equal(_logits(fresh), want)
