"""The tiny models of the vLLM tests: real transformers configs, their seeded weights in canonical space."""

from __future__ import annotations

import torch
import transformers as tf

from refitflow.layouts import canonical_shapes, hf
from refitflow.layouts.canonical import ModelDims, to_canonical

# vocab 100: vLLM pads it to 128 rows (a multiple of 64), so at TP 2 rank 1 holds 36 real rows and 28 of padding
BASE = dict(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
            num_key_value_heads=2, tie_word_embeddings=False)  # fmt: skip


# DeepSeek-V3 shaped latent attention (q LoRA), every layer dense (first_k_dense_replace = the layers)
DEEPSEEK = dict(
    vocab_size=100, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=8, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=2,
    q_lora_rank=48, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_group=1, topk_group=1,
    tie_word_embeddings=False,
)  # fmt: skip
MODELS = {"qwen2": tf.Qwen2ForCausalLM, "mixtral": tf.MixtralForCausalLM, "deepseek": tf.DeepseekV3ForCausalLM}


def config(kind: str) -> tf.PretrainedConfig:
    if kind == "qwen2":
        return tf.Qwen2Config(**BASE)
    if kind == "mixtral":
        return tf.MixtralConfig(**BASE | {"intermediate_size": 32, "num_local_experts": 4, "num_experts_per_tok": 2})
    if kind == "deepseek":
        return tf.DeepseekV3Config(**DEEPSEEK)
    raise ValueError(kind)


def dims(kind: str) -> ModelDims:
    return hf.dims_from_config(config(kind))


def canonical(kind: str, seed: int) -> dict[str, torch.Tensor]:
    """Version ``seed`` of the model: a freshly initialised transformers model, bf16, in canonical space."""
    torch.manual_seed(seed)
    model = MODELS[kind](config(kind)).to(torch.bfloat16)
    d = dims(kind)
    return to_canonical([(hf.layout(d), model.state_dict())], canonical_shapes(d))
