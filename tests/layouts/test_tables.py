"""The layout tables against hand-written conventions (the round trip alone cannot catch a wrong table)."""

from __future__ import annotations

import pytest
import torch

from refitflow.core.errors import ConfigError
from refitflow.layouts import ModelDims, Parallel, canonical_shapes, fused, hf, megatron, sglang
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
    assert torch.equal(got[L + "mlp.experts.routed_experts.w13_weight"], torch.cat([gate[2:, 16:], up[2:, 16:]], dim=1))
    assert torch.equal(got[L + "mlp.experts.routed_experts.w2_weight"], down[2:, :, 16:])
    meg = from_canonical(megatron.layout(MOE, Parallel(tp=1, ep=2, ep_rank=1)), c)  # sequential: Megatron's default
    fc1 = meg["decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight"]
    assert torch.equal(fc1, torch.cat([gate[3], up[3]]))
    assert torch.equal(meg["decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight"], down[2])


def test_legacy_per_expert_names_map_onto_the_stacked_experts() -> None:
    c = _canon(MOE)
    got = from_canonical(hf.layout(MOE, experts="mixtral"), c)
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


DS = ModelDims(
    vocab=200, hidden=64, layers=2, heads=4, kv_heads=4, head_dim=16, ffn=96, dense_layers=1, experts=8,
    expert_ffn=32, shared_ffn=32, router_bias=True, q_lora_rank=48, kv_lora_rank=32, rope_dim=8, v_head_dim=16,
)  # fmt: skip
M = "model.layers.1."  # DS's MoE layer


def test_vllm_latent_attention_fuses_the_a_projections_and_splits_whole_heads() -> None:
    c = _canon(DS)
    a = "self_attn."
    for r in range(2):
        got = from_canonical(fused.layout(DS, Parallel(tp=2, tp_rank=r)), c)
        # deepseek_v2.py: MergedColumnParallelLinear([q_lora_rank, kv_lora_rank + rope], disable_tp=True)
        want = torch.cat([c[M + a + "q_a_proj.weight"], c[M + a + "kv_a_proj_with_mqa.weight"]])
        assert torch.equal(got[M + a + "fused_qkv_a_proj.weight"], want)
        # kv_b_proj rows are per head [k_nope (16); v (16)]: 2 of 4 heads per rank
        assert torch.equal(got[M + a + "kv_b_proj.weight"], c[M + a + "kv_b_proj.weight"][r * 64 : (r + 1) * 64])
        assert torch.equal(got[M + a + "q_b_proj.weight"], c[M + a + "q_b_proj.weight"][r * 48 : (r + 1) * 48])
        assert torch.equal(got[M + a + "o_proj.weight"], c[M + a + "o_proj.weight"][:, r * 32 : (r + 1) * 32])
        shared = "mlp.shared_experts."
        gate, up = (c[M + shared + f"{x}_proj.weight"][r * 16 : (r + 1) * 16] for x in ("gate", "up"))
        assert torch.equal(got[M + shared + "gate_up_proj.weight"], torch.cat([gate, up]))
        assert torch.equal(got[M + "mlp.gate.e_score_correction_bias"], c[M + "mlp.gate.e_score_correction_bias"])
        assert "model.layers.0.mlp.gate_up_proj.weight" in got and "model.layers.0.mlp.gate.weight" not in got
    sgl = from_canonical(sglang.layout(DS, Parallel(tp=2)), c)
    assert torch.equal(sgl[M + a + "fused_qkv_a_proj_with_mqa.weight"], want)


def test_megatron_latent_attention_te_replicates_down_projections_and_fuses_their_norms() -> None:
    c = _canon(DS)
    a = "decoder.layers.1.self_attention."
    te = from_canonical(megatron.layout(DS, Parallel(tp=2, tp_rank=1)), c)
    local = from_canonical(megatron.layout(DS, Parallel(tp=2, tp_rank=1), spec="local"), c)
    assert torch.equal(te[a + "linear_q_down_proj.weight"], c[M + "self_attn.q_a_proj.weight"])
    assert torch.equal(local[a + "linear_q_down_proj.weight"], c[M + "self_attn.q_a_proj.weight"][24:])
    assert torch.equal(te[a + "linear_kv_up_proj.layer_norm_weight"], c[M + "self_attn.kv_a_layernorm.weight"])
    assert torch.equal(local[a + "kv_layernorm.weight"], c[M + "self_attn.kv_a_layernorm.weight"])
    assert torch.equal(te[a + "linear_kv_up_proj.weight"], c[M + "self_attn.kv_b_proj.weight"][64:])
    assert torch.equal(te["decoder.layers.1.mlp.router.expert_bias"], c[M + "mlp.gate.e_score_correction_bias"])
    norm = c["model.layers.0.post_attention_layernorm.weight"]
    assert torch.equal(te["decoder.layers.0.mlp.linear_fc1.layer_norm_weight"], norm)  # the dense first layer
    assert torch.equal(local["decoder.layers.0.pre_mlp_layernorm.weight"], norm)


def test_megatron_grouped_experts_are_expert_tp_sliced_like_megatron_cores_default() -> None:
    c = _canon(MOE)
    gate, up, down = (c[L + f"mlp.experts.{x}"] for x in ("gate", "up", "down"))
    got = from_canonical(megatron.layout(MOE, Parallel(tp=2, tp_rank=1, ep=2, ep_rank=1), experts="grouped"), c)
    # expert TP defaults to TP (2): expert 3 is local expert 1 on EP rank 1; TP rank 1 holds the second halves
    assert torch.equal(got["decoder.layers.0.mlp.experts.linear_fc1.weight1"], torch.cat([gate[3, 16:], up[3, 16:]]))
    assert torch.equal(got["decoder.layers.0.mlp.experts.linear_fc2.weight0"], down[2, :, 16:])
    assert torch.equal(
        got["decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"], c[L + "input_layernorm.weight"]
    )


def test_vllm_places_uneven_experts_linearly_and_flattens_expert_tp_over_dp() -> None:
    c = _canon(MOE)  # 4 experts over 3 EP ranks: vLLM's linear placement gives 2, 1, 1
    w13 = [
        from_canonical(fused.layout(MOE, Parallel(ep=3, ep_rank=r)), c)[L + "mlp.experts.routed_experts.w13_weight"]
        for r in (0, 1, 2)
    ]
    assert [t.shape[0] for t in w13] == [2, 1, 1]
    assert torch.equal(w13[1][0], torch.cat([c[L + "mlp.experts.gate"][2], c[L + "mlp.experts.up"][2]]))
    # TP 2 × DP 2 without expert parallelism: experts TP-split over 4, attention over 2
    par = fused.parallel(tp=2, tp_rank=1, dp=2, dp_rank=1)
    assert (par.tp_rank, par.etp, par.etp_rank, par.ep) == (1, 4, 3, 1)
    got = from_canonical(fused.layout(MOE, par), c)
    assert torch.equal(got[L + "mlp.experts.routed_experts.w2_weight"], c[L + "mlp.experts.down"][:, :, 24:])
    ep = fused.parallel(tp=2, tp_rank=1, dp=2, dp_rank=1, expert_parallel=True)
    assert (ep.ep, ep.ep_rank, ep.etp) == (4, 3, 1)


def test_sglang_pads_the_vocabulary_to_64_times_tp_when_64_does_not_split() -> None:
    assert sglang.padded_vocab(200, 4) == 256  # 256 splits over 4
    assert sglang.padded_vocab(200, 3) == 384  # 256 does not split over 3: 64 × 3 = 192 → 384
    d = ModelDims(vocab=200, hidden=64, layers=1, heads=6, kv_heads=3, head_dim=8, ffn=96)
    embed = [sglang.layout(d, Parallel(tp=3, tp_rank=r))["model.embed_tokens.weight"] for r in range(3)]
    assert [e.shape for e in embed] == [(128, 64)] * 3
    assert [[s.cbox[0] for s in e.segments] for e in embed] == [[(0, 128)], [(128, 200)], []]


def test_hf_per_expert_checkpoint_names_map_onto_the_stacked_experts() -> None:
    c = _canon(DS)
    got = from_canonical(hf.layout(DS, experts="per_expert"), c)
    assert torch.equal(got[M + "mlp.experts.5.up_proj.weight"], c[M + "mlp.experts.up"][5])
    assert torch.equal(got[M + "mlp.experts.7.down_proj.weight"], c[M + "mlp.experts.down"][7])
    assert M + "mlp.shared_experts.gate_proj.weight" in got and "model.layers.0.mlp.experts.0.up_proj.weight" not in got


def test_kimi_k2_and_qwen3_moe_configs_read_into_model_dims() -> None:
    import transformers as tf

    kimi = tf.DeepseekV3Config(
        vocab_size=163840, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=61, num_attention_heads=64, num_key_value_heads=64, n_routed_experts=384,
        n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, tie_word_embeddings=False,
    )  # fmt: skip
    kimi.model_type = "kimi_k2"  # Kimi-K2's config.json: DeepseekV3ForCausalLM under its own model_type
    d = hf.dims_from_config(kimi)
    assert (d.experts, d.expert_ffn, d.dense_layers, d.ffn, d.shared_ffn, d.router_bias) == (
        384,
        2048,
        1,
        18432,
        2048,
        True,
    )
    assert (d.heads, d.kv_heads, d.head_dim, d.rope_dim, d.v_head_dim, d.q_lora_rank, d.kv_lora_rank) == (
        64, 64, 128, 64, 128, 1536, 512,
    )  # fmt: skip
    shapes = canonical_shapes(d)
    assert shapes["model.layers.60.self_attn.kv_b_proj.weight"] == (64 * 256, 512)
    assert shapes["model.layers.60.mlp.experts.gate"] == (384, 2048, 7168)
    assert "model.layers.0.mlp.gate_proj.weight" in shapes and "model.layers.0.mlp.gate.weight" not in shapes
    qwen = tf.Qwen3MoeConfig(num_experts=8, moe_intermediate_size=32, mlp_only_layers=[1])
    with pytest.raises(ConfigError, match="mlp_only_layers"):
        hf.dims_from_config(qwen)


def test_model_dims_refuse_inconsistent_shapes() -> None:
    with pytest.raises(ConfigError, match="expert_ffn"):
        ModelDims(vocab=8, hidden=8, layers=2, heads=2, kv_heads=2, head_dim=4, experts=4)
    with pytest.raises(ConfigError, match="latent attention"):
        ModelDims(
            vocab=8,
            hidden=8,
            layers=2,
            heads=2,
            kv_heads=1,
            head_dim=4,
            ffn=8,
            kv_lora_rank=4,
            rope_dim=2,
            v_head_dim=4,
        )
    with pytest.raises(ConfigError, match="two table entries"):
        from refitflow.layouts.rules import Tables, build

        norm = ("rep", ("input_layernorm.weight",))
        build(Tables(first={}, last={}, attention={"norm": norm}, dense={"norm": norm}), "x", D, Parallel())


def test_layout_for_reads_a_config_and_names_mixtrals_moe_block() -> None:
    import transformers as tf

    mixtral = tf.MixtralConfig(vocab_size=200, hidden_size=64, intermediate_size=32, num_hidden_layers=1,
                               num_attention_heads=8, num_key_value_heads=2, num_local_experts=4)  # fmt: skip
    got = fused.layout_for(mixtral, Parallel(tp=2, tp_rank=1))
    assert got[L + "block_sparse_moe.experts.routed_experts.w13_weight"].shape == (4, 32, 64)
    assert L + "block_sparse_moe.gate.weight" in got and L + "mlp.experts.routed_experts.w13_weight" not in got
    assert got["model.embed_tokens.weight"].shape == (128, 64)  # 200 → 256 rows, 128 per rank
    deepseek = tf.DeepseekV3Config(vocab_size=200, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                   q_lora_rank=48, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
                                   v_head_dim=16, first_k_dense_replace=1, intermediate_size=96)  # fmt: skip
    assert L + "self_attn.fused_qkv_a_proj_with_mqa.weight" in sglang.layout_for(deepseek, Parallel(tp=2))


def test_pipeline_stages_split_layers_as_vllm_and_megatron_do() -> None:
    # vLLM get_pp_indices: 61 layers over 16 stages: 3 each, the 13 left one each on stages 2..14
    assert fused.pp_split(61, 16) == (3, 3, *[4] * 13, 3) and fused.pp_split(3, 2) == (2, 1)
    d = ModelDims(vocab=128, hidden=64, layers=3, heads=8, kv_heads=2, head_dim=8, ffn=96)
    last = fused.layout(d, Parallel(pp=2, pp_rank=1))
    assert sorted(n for n in last if not n.startswith("model.layers.2.")) == ["lm_head.weight", "model.norm.weight"]
    first = megatron.layout(d, Parallel(pp=2, pp_rank=0), pp_layers=[1, 2])  # Megatron numbers layers per stage
    second = megatron.layout(d, Parallel(pp=2, pp_rank=1), pp_layers=[1, 2])
    assert "embedding.word_embeddings.weight" in first and "decoder.layers.1.mlp.linear_fc2.weight" not in first
    qkv = second["decoder.layers.1.self_attention.linear_qkv.weight"]
    assert {s.canonical.split(".self_attn")[0] for s in qkv.segments} == {"model.layers.2"}
    with pytest.raises(ConfigError, match=r"layers over pipeline stages \(3\) is not divisible by 2"):
        megatron.layout(d, Parallel(pp=2))  # 3 layers are not even over 2 stages: say how
