"""The layout tables against hand-written conventions (the round trip alone cannot catch a wrong table)."""

from __future__ import annotations

import torch

from refitflow.layouts import ModelDims, Parallel, canonical_shapes, fused, megatron
from refitflow.layouts.canonical import from_canonical

D = ModelDims(vocab=128, hidden=64, layers=1, heads=8, kv_heads=2, head_dim=8, ffn=96, qkv_bias=True)
MOE = ModelDims(vocab=128, hidden=64, layers=1, heads=8, kv_heads=2, head_dim=8, experts=4, expert_ffn=32)
L = "model.layers.0."


def _canon(d: ModelDims) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {n: torch.randn(s) for n, s in canonical_shapes(d).items()}


def test_megatron_qkv_is_interleaved_per_query_group() -> None:
    c = _canon(D)
    q, k, v = (c[L + f"self_attn.{x}_proj.weight"] for x in "qkv")
    # Megatron: view q as (groups, heads per group * head_dim, hidden) and put each group's k, v after it
    groups = torch.cat([q.view(2, 4 * 8, 64), k.view(2, 8, 64), v.view(2, 8, 64)], dim=1)
    for r in range(2):
        got = from_canonical(megatron.layout(D, Parallel(tp=2, tp_rank=r)), c)
        assert torch.equal(got["decoder.layers.0.self_attention.linear_qkv.weight"], groups[r])
        gate, up = c[L + "mlp.gate_proj.weight"].chunk(2)[r], c[L + "mlp.up_proj.weight"].chunk(2)[r]
        assert torch.equal(got["decoder.layers.0.mlp.linear_fc1.weight"], torch.cat([gate, up]))
        assert torch.equal(
            got["decoder.layers.0.self_attention.linear_proj.weight"],
            c[L + "self_attn.o_proj.weight"][:, r * 32 :][:, :32],
        )


def test_fused_qkv_replicates_kv_heads_when_tp_exceeds_them() -> None:
    c = _canon(D)
    q, k, v = (c[L + f"self_attn.{x}_proj.weight"] for x in "qkv")
    for r in range(4):
        got = from_canonical(fused.layout(D, Parallel(tp=4, tp_rank=r)), c)
        kv = r // 2  # 4 ranks over 2 kv heads: each kv head on two ranks
        want = torch.cat([q[r * 16 : (r + 1) * 16], k[kv * 8 : (kv + 1) * 8], v[kv * 8 : (kv + 1) * 8]])
        assert torch.equal(got[L + "self_attn.qkv_proj.weight"], want)
        assert torch.equal(got["model.embed_tokens.weight"], c["model.embed_tokens.weight"][r * 32 : (r + 1) * 32])
        assert torch.equal(got[L + "mlp.down_proj.weight"], c[L + "mlp.down_proj.weight"][:, r * 24 : (r + 1) * 24])


def test_experts_w13_and_megatron_local_experts() -> None:
    c = _canon(MOE)
    gate, up, down = (c[L + f"mlp.experts.{x}"] for x in ("gate", "up", "down"))
    got = from_canonical(fused.layout(MOE, Parallel(tp=2, tp_rank=1, ep=2, ep_rank=1)), c)
    assert torch.equal(got[L + "mlp.experts.w13_weight"], torch.cat([gate[2:, 16:], up[2:, 16:]], dim=1))
    assert torch.equal(got[L + "mlp.experts.w2_weight"], down[2:, :, 16:])
    meg = from_canonical(megatron.layout(MOE, Parallel(tp=1, ep=2, ep_rank=1)), c)
    fc1 = meg["decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight"]
    assert torch.equal(fc1, torch.cat([gate[3], up[3]]))
    assert torch.equal(meg["decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight"], down[2])


def test_legacy_per_expert_names_map_onto_the_stacked_experts() -> None:
    from refitflow.layouts import hf

    c = _canon(MOE)
    got = from_canonical(hf.layout(MOE, legacy_experts=True), c)
    assert torch.equal(got[L + "block_sparse_moe.experts.2.w1.weight"], c[L + "mlp.experts.gate"][2])
    assert torch.equal(got[L + "block_sparse_moe.experts.2.w3.weight"], c[L + "mlp.experts.up"][2])
    assert torch.equal(got[L + "block_sparse_moe.experts.3.w2.weight"], c[L + "mlp.experts.down"][3])
    fused_hf = from_canonical(hf.layout(MOE), c)[L + "mlp.experts.gate_up_proj"]
    assert torch.equal(fused_hf, torch.cat([c[L + "mlp.experts.gate"], c[L + "mlp.experts.up"]], dim=1))


def test_run_helpers_agree() -> None:
    from refitflow.layouts.boxes import row_runs, run_count, run_length

    shape = (6, 5, 4)
    for box in [((0, 6), (1, 3), (0, 4)), ((2, 3), (0, 5), (1, 2)), ((0, 6), (0, 5), (0, 4)), ((1, 4), (0, 5), (0, 4))]:
        runs = row_runs(box, shape)
        assert len(runs) == run_count(box, shape) and all(n == run_length(box, shape) for _, n in runs)
