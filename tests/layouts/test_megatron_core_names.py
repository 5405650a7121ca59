"""Megatron layouts against Megatron-core itself.

``mcore_names.json`` holds every rank's parameter names and shapes of tiny GPT models that
megatron-core 0.16.1 built on the CPU over gloo (local spec; regenerate with ``_mcore_names.py``):
a dense GQA model at TP 2, a Qwen3-MoE-shaped one and a DeepSeek-V3-shaped one (latent attention,
a dense first layer, shared experts, router expert bias) at TP 2 × EP 2, and the DeepSeek one at
PP 2 (stages of 1 and 2 layers) × EP 2; vocabulary 200 padded to 256. The Transformer Engine spec
cannot be built without CUDA; its names are the local ones renamed by the rules below, each taken
from megatron-core's source (file:line in megatron-core 0.16.1).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from refitflow.layouts import ModelDims, Parallel, megatron

DATA = json.loads((Path(__file__).parent / "mcore_names.json").read_text())
CASES = sorted(DATA["cases"])


def _places(case: str) -> list[tuple[ModelDims, Parallel, dict]]:
    c = DATA["cases"][case]
    d = ModelDims(**c["dims"])
    return [
        (
            d,
            Parallel(
                tp=c["tp"], tp_rank=r["tp_rank"], ep=c["ep"], ep_rank=r["ep_rank"], pp=c["pp"], pp_rank=r["pp_rank"]
            ),
            r,
        )
        for r in c["ranks"]
    ]


def _layout(case: str, d: ModelDims, par: Parallel, **options) -> dict:
    return megatron.layout(d, par, pp_layers=DATA["cases"][case]["pp_layers"], **options)


def _shapes(layout: dict) -> dict[str, list[int]]:
    return {n: list(lt.shape) for n, lt in layout.items()}


def test_the_pinned_names_come_from_megatron_core_0_16() -> None:
    assert DATA["megatron_core"] == "0.16.1" and DATA["spec"] == "local"
    assert CASES == ["deepseek_pp2_ep2", "deepseek_tp2_ep2", "gqa_dense_tp2", "qwen3_moe_tp2_ep2"]


@pytest.mark.parametrize("case", CASES)
def test_local_spec_names_and_shapes_are_megatron_cores(case: str) -> None:
    for d, par, rank in _places(case):
        # Megatron-core's default expert TP is TP (model_parallel_config.py:413)
        assert (par.etp, par.etp_rank) == (rank["expert_tp"], rank["expert_tp_rank"])
        assert _shapes(_layout(case, d, par, spec="local")) == rank["params"]


MLA_NORMS = {
    "self_attention.q_layernorm.weight": "self_attention.linear_q_up_proj.layer_norm_weight",
    "self_attention.kv_layernorm.weight": "self_attention.linear_kv_up_proj.layer_norm_weight",
}


def _te(params: dict[str, list[int]], d: ModelDims, tp: int, grouped: bool) -> dict[str, list[int]]:
    """The local spec's names as the Transformer Engine spec names them."""
    moe_layers = {m.group(1) for n in params if (m := re.match(r"decoder\.layers\.(\d+)\.mlp\.router\.", n))}
    out = {}
    for name, shape in params.items():
        m = re.match(r"decoder\.layers\.(\d+)\.(.*)", name)
        layer, rest = (m.group(1), m.group(2)) if m else (None, name)
        if rest == "input_layernorm.weight" and not d.mla:
            # gpt_layer_specs.py:279,402: linear_qkv is TELayerNormColumnParallelLinear, the input norm is
            # fused into it ("input_layernorm." -> "self_attention.linear_qkv.layer_norm_")
            rest = "self_attention.linear_qkv.layer_norm_weight"
        elif rest == "pre_mlp_layernorm.weight" and layer not in moe_layers:
            # gpt_layer_specs.py:291,403,476: a dense layer's fc1 fuses the pre-MLP norm; a MoE layer keeps TENorm
            rest = "mlp.linear_fc1.layer_norm_weight"
        elif d.mla and rest in MLA_NORMS:
            # gpt_layer_specs.py:235-261: MLA's up projections are column_parallel_layer_norm_linear (qk_layernorm)
            rest = MLA_NORMS[rest]
        elif rest.endswith("_down_proj.weight"):
            # multi_latent_attention.py:408,453: TELinear with parallel_mode="duplicated": not TP-split
            shape = [shape[0] * tp, *shape[1:]]
        elif grouped and (e := re.match(r"mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight", rest)):
            # TEGroupedMLP (experts.py:512): TE GroupedLinear's parameters weight0..weight{n-1}
            # (extensions/transformer_engine.py:1754,1780)
            rest = f"mlp.experts.{e.group(2)}.weight{e.group(1)}"
        out[name if layer is None else f"decoder.layers.{layer}.{rest}"] = shape
    return out


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("experts", ["sequential", "grouped"])
def test_transformer_engine_spec_names_follow_megatron_cores_source(case: str, experts: str) -> None:
    for d, par, rank in _places(case):
        want = _te(rank["params"], d, par.tp, grouped=experts == "grouped")
        got = _shapes(_layout(case, d, par, experts=experts))  # spec="te" is the default
        assert got == want
    if case == "deepseek_tp2_ep2":  # the renames above did apply
        assert "decoder.layers.1.self_attention.linear_kv_up_proj.layer_norm_weight" in got
        assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in got
        assert "decoder.layers.1.pre_mlp_layernorm.weight" in got
        assert ("decoder.layers.2.mlp.experts.linear_fc2.weight3" in got) == (experts == "grouped")
