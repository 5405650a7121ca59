"""Build tiny Megatron-core GPT models on the CPU (gloo) and record every rank's parameter names and shapes.

Not a test: it regenerates ``mcore_names.json``, which ``test_megatron_core_names.py`` pins. It needs
megatron-core, which refitflow does not depend on; run it in a venv of its own:

    python -m venv /tmp/mcore && /tmp/mcore/bin/pip install torch==2.13.0 numpy 'packaging>=24.2' einops
    /tmp/mcore/bin/pip install --no-deps megatron-core==0.16.1
    /tmp/mcore/bin/python tests/layouts/_mcore_names.py tests/layouts/mcore_names.json

Only the local spec can be built here: the Transformer Engine spec needs TE, which needs CUDA. Two
stand-ins, for names and shapes only (both noted in the JSON): megatron-core 0.16.1 calls
``torch.cuda.current_device()`` unconditionally in MLA's ``RotaryEmbedding`` and for the router's
``expert_bias`` buffer, so it answers "cpu"; and the local spec's core attention
(``DotProductAttention``) does not accept MLA's ``k_channels``, and ``multi_latent_attention`` believes
TE is present whenever ``megatron.core.extensions.transformer_engine`` imports (it does, with ``TELinear
= None``) — so MLA gets a parameterless core attention and ``HAVE_TE = False``.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import socket
import sys

DEEPSEEK = dict(vocab=200, hidden=64, layers=3, heads=8, kv_heads=8, head_dim=16, ffn=96, dense_layers=1, experts=8,
                expert_ffn=32, shared_ffn=32, router_bias=True, q_lora_rank=48, kv_lora_rank=32, rope_dim=8,
                v_head_dim=16)  # fmt: skip
CASES = {  # name: (tp, ep, pp, layers in the first pipeline stage, the ModelDims the test compares against)
    "gqa_dense_tp2": (2, 1, 1, None, dict(vocab=200, hidden=64, layers=3, heads=8, kv_heads=2, head_dim=8, ffn=96,
                                 qkv_bias=True, qk_norm=True)),
    "qwen3_moe_tp2_ep2": (2, 2, 1, None, dict(vocab=200, hidden=64, layers=3, heads=8, kv_heads=2, head_dim=8,
                                     qk_norm=True, experts=8, expert_ffn=32)),
    "deepseek_tp2_ep2": (2, 2, 1, None, DEEPSEEK),
    "deepseek_pp2_ep2": (1, 2, 2, 1, DEEPSEEK),  # stages of 1 and 2 layers
}  # fmt: skip


def _config(d: dict, tp: int, ep: int, pp: int, first: int | None):
    import torch
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    common = dict(
        num_layers=d["layers"],
        hidden_size=d["hidden"],
        num_attention_heads=d["heads"],
        use_cpu_initialization=True,
        normalization="RMSNorm",
        gated_linear_unit=True,
        add_bias_linear=False,
        tensor_model_parallel_size=tp,
        expert_model_parallel_size=ep,
        pipeline_model_parallel_size=pp,
        num_layers_in_first_pipeline_stage=first,
        pipeline_dtype=torch.float32 if pp > 1 else None,
        params_dtype=torch.float32,
        qk_layernorm=d.get("qk_norm", False) or "kv_lora_rank" in d,
    )
    if d.get("experts"):
        common |= dict(
            num_moe_experts=d["experts"],
            moe_ffn_hidden_size=d["expert_ffn"],
            moe_router_topk=2,
            moe_layer_freq=[0] * d.get("dense_layers", 0) + [1] * (d["layers"] - d.get("dense_layers", 0)),
        )
    if "kv_lora_rank" in d:
        return MLATransformerConfig(
            **common,
            ffn_hidden_size=d["ffn"],
            q_lora_rank=d["q_lora_rank"],
            kv_lora_rank=d["kv_lora_rank"],
            qk_head_dim=d["head_dim"],
            qk_pos_emb_head_dim=d["rope_dim"],
            v_head_dim=d["v_head_dim"],
            rope_type="rope",
            moe_shared_expert_intermediate_size=d["shared_ffn"],
            moe_router_enable_expert_bias=d["router_bias"],
            moe_router_score_function="sigmoid",
        )
    return TransformerConfig(
        **common,
        num_query_groups=d["kv_heads"],
        kv_channels=d["head_dim"],
        ffn_hidden_size=d.get("ffn") or d["expert_ffn"],
        add_qkv_bias=d.get("qkv_bias", False),
    )


def _rank(rank: int, world: int, case: str, port: int, out: mp.Queue) -> None:
    import torch
    import torch.distributed as dist

    tp, ep, pp, first, d = CASES[case]
    os.environ |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.cuda.current_device = lambda: "cpu"  # stand-in 1 (see the module docstring)
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp, expert_model_parallel_size=ep, pipeline_model_parallel_size=pp
    )
    cfg = _config(d, tp, ep, pp, first)
    pp_rank = ps.get_pipeline_model_parallel_rank()
    spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization="RMSNorm")
    if "kv_lora_rank" in d:  # stand-in 2
        import megatron.core.transformer.multi_latent_attention as mla

        class NoCoreAttention(torch.nn.Module):
            def __init__(self, *args: object, **kwargs: object) -> None:
                super().__init__()

        mla.HAVE_TE = False
        for layer in spec.layer_specs:
            layer.submodules.self_attention.submodules.core_attention = NoCoreAttention
    padded = -(-d["vocab"] // (128 * tp)) * 128 * tp  # what Megatron-LM's _vocab_size_with_padding hands GPTModel
    model = GPTModel(
        config=cfg,
        transformer_layer_spec=spec,
        vocab_size=padded,
        max_sequence_length=64,
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
        pre_process=pp_rank == 0,
        post_process=pp_rank == pp - 1,
    )
    params = {n: list(t.shape) for n, t in model.state_dict().items() if not n.endswith("_extra_state")}
    out.put(
        {
            "rank": rank,
            "tp_rank": ps.get_tensor_model_parallel_rank(),
            "pp_rank": pp_rank,
            "ep_rank": ps.get_expert_model_parallel_rank(),
            "expert_tp": ps.get_expert_tensor_parallel_world_size(),
            "expert_tp_rank": ps.get_expert_tensor_parallel_rank(),
            "params": params,
        }
    )
    dist.destroy_process_group()


def main() -> None:
    from importlib.metadata import version

    result: dict = {"megatron_core": version("megatron-core"), "spec": "local", "cases": {}}
    ctx = mp.get_context("spawn")
    for case, (tp, ep, pp, first, d) in CASES.items():
        queue = ctx.Queue()
        world = tp * ep * pp  # expert TP = TP (the default): EP spans the data-parallel ranks
        with socket.socket() as sock:  # a free port for this case's rendezvous
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        procs = [ctx.Process(target=_rank, args=(r, world, case, port, queue)) for r in range(world)]
        for p in procs:
            p.start()
        ranks = sorted((queue.get(timeout=300) for _ in procs), key=lambda r: r["rank"])
        for p in procs:
            p.join(60)
        stages = None if first is None else [first, d["layers"] - first]
        result["cases"][case] = {"tp": tp, "ep": ep, "pp": pp, "pp_layers": stages, "dims": d, "ranks": ranks}
    with open(sys.argv[1], "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
