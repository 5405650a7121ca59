"""The tiny models of the vLLM tests: real transformers configs, their seeded weights in canonical space."""

from __future__ import annotations

import torch
import transformers as tf

from refitflow.layouts import canonical_shapes, hf
from refitflow.layouts.canonical import ModelDims, to_canonical

# vocab 100: vLLM pads it to 128 rows (a multiple of 64), so at TP 2 rank 1 holds 36 real rows and 28 of padding
BASE = dict(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
            num_key_value_heads=2, tie_word_embeddings=False)  # fmt: skip


def config(kind: str) -> tf.PretrainedConfig:
    if kind == "qwen2":
        return tf.Qwen2Config(**BASE)
    if kind == "mixtral":
        return tf.MixtralConfig(**BASE | {"intermediate_size": 32, "num_local_experts": 4, "num_experts_per_tok": 2})
    raise ValueError(kind)


def dims(kind: str) -> ModelDims:
    return hf.dims_from_config(config(kind))


def canonical(kind: str, seed: int) -> dict[str, torch.Tensor]:
    """Version ``seed`` of the model: a freshly initialised transformers model, bf16, in canonical space."""
    torch.manual_seed(seed)
    model = (tf.Qwen2ForCausalLM if kind == "qwen2" else tf.MixtralForCausalLM)(config(kind)).to(torch.bfloat16)
    d = dims(kind)
    return to_canonical([(hf.layout(d), model.state_dict())], canonical_shapes(d))
