"""Real transformers models: Megatron-sharded trainers refit inference ranks at another TP/EP, bit-exactly.

Families: Llama, Qwen2, Qwen3, Mixtral, Qwen3-MoE (qk norms, experts, no shared experts), DeepSeek-V3 /
Kimi-K2 shaped (latent attention, a dense first layer, then 8 experts with a shared expert and a router
bias), DeepSeek-V2 shaped (latent attention without a q LoRA rank). The trainer publishes bf16 Megatron
layouts (Transformer Engine names unless said otherwise); receivers hold fp32 vLLM (or SGLang) layouts.
"""

from __future__ import annotations

import anyio
import pytest

from refitflow.layouts import Parallel, fused
from refitflow.layouts.boxes import volume
from tests.layouts._models import _model, _refit, assert_same_logits


def _vllm(tp: int, expert_parallel: bool = False, dp: int = 1, pp: int = 1) -> list:
    return [
        fused.parallel(tp=tp, tp_rank=r % tp, dp=dp, dp_rank=r // tp % dp, expert_parallel=expert_parallel, pp=pp,
                       pp_rank=r // (tp * dp))
        for r in range(tp * dp * pp)
    ]  # fmt: skip


def _megatron_pp(tp: int, pp: int) -> list:
    return [Parallel(tp=tp, tp_rank=r % tp, pp=pp, pp_rank=r // tp) for r in range(tp * pp)]


GROUPED = {"experts": "grouped"}
CASES = [  # (kind, kv heads, trainer (tp, ep), receivers, trainer layout options, receiver layout)
    ("llama", 2, (2, 1), (4, 1), {}, "fused"),
    ("llama", 4, (4, 1), (1, 1), {}, "fused"),
    ("llama", 2, (1, 1), (2, 1), {"spec": "local"}, "fused"),
    ("qwen2", 2, (2, 1), (4, 1), {}, "fused"),
    ("qwen3", 2, (2, 1), (1, 1), {}, "fused"),
    ("mixtral", 2, (1, 2), (2, 1), {}, "fused"),
    ("mixtral", 2, (2, 2), (1, 2), GROUPED, "fused"),
    ("qwen3_moe", 2, (2, 2), _vllm(4, expert_parallel=True), GROUPED, "fused"),
    ("qwen3_moe", 2, (2, 2), _vllm(2), {"spec": "local"}, "fused"),
    ("qwen3_moe", 2, (2, 2), _vllm(2, dp=2), {}, "fused"),  # experts TP-split over tp × dp = 4
    ("deepseek_v3", 8, (2, 2), _vllm(4, expert_parallel=True), GROUPED, "fused"),
    ("deepseek_v3", 8, (2, 2), _vllm(1), {}, "fused"),
    ("deepseek_v3", 8, (2, 2), (2, 1), {"spec": "local"}, "sglang"),
    ("deepseek_v2", 8, (2, 2), _vllm(2, expert_parallel=True), {}, "fused"),
    # pipeline stages: Megatron [1, 2] layers (numbered per stage) into vLLM's split [2, 1] (global numbers)
    ("deepseek_v3", 8, _megatron_pp(2, 2), _vllm(2, expert_parallel=True, pp=2), {"pp_layers": [1, 2]}, "fused"),
    ("qwen3_moe", 2, _megatron_pp(1, 2), _vllm(2), {"experts": "grouped"}, "fused"),
]


@pytest.mark.asyncio
@pytest.mark.parametrize(("kind", "kv", "train", "infer", "options", "receiver"), CASES)
async def test_megatron_trainer_refits_inference_ranks_bit_exactly(kind, kv, train, infer, options, receiver) -> None:
    trainer = _model(kind, kv)
    with anyio.fail_after(60):
        ranks, maps, results = await _refit(trainer, train, infer, train_options=options, receiver=receiver)
    assert_same_logits(trainer, kind, maps, ranks, kv_heads=kv)
    assert all(r.unverified_bytes == 0 for r in results)  # verify="strict": every pulled block checked


@pytest.mark.asyncio
@pytest.mark.parametrize(("kind", "kv", "train", "infer", "options", "receiver"), [CASES[0], CASES[4], *CASES[7:11]])
async def test_each_inference_rank_pulls_exactly_its_slice(kind, kv, train, infer, options, receiver) -> None:
    trainer = _model(kind, kv)
    with anyio.fail_after(60):
        # min_run_bytes=0, descriptor_bytes=0: read even 16-byte column runs as such (by default they read their
        # enclosing rows)
        ranks, maps, results = await _refit(trainer, train, infer, train_options=options, receiver=receiver,
                                            verify="pulled", min_run_bytes=0, descriptor_bytes=0)  # fmt: skip
    for tensors, layout, result in zip(ranks, maps, results, strict=True):
        mapped = sum(volume(s.lbox) for lt in layout.values() for s in lt.segments)
        assert mapped <= sum(t.numel() for t in tensors.values())  # less only by vocabulary padding
        assert result.nbytes == result.ideal_bytes == 2 * mapped  # bf16 source bytes of this rank's slice
