"""What the tests of a real vLLM server share: the trainer process (``_hf_trainer``), transformers' greedy
tokens to compare with, vLLM's own update sequence (paused), and the tiny checkpoints the servers boot from."""

from __future__ import annotations

import json
import pathlib
import sys
from dataclasses import dataclass
from typing import Any, Self

import torch
import transformers as tf

from refitflow.integrations.hosting.info import RefitflowInitInfo
from tests.integrations._vllm_cpu import VllmServer
from tests.transports._nixl_peer import LineChild

__all__ = ["PROMPT", "TIE", "TOKENS", "Greedy", "HfTrainer", "bench_llama", "llama_checkpoint", "mixtral_checkpoint",
           "save", "update"]  # fmt: skip

ROOT = str(pathlib.Path(__file__).resolve().parents[2])
PROMPT, TOKENS = [1, 17, 42, 99, 7], 12
TIE = {"float32": 1e-4, "bfloat16": 0.02}  # logit gaps within another kernel's rounding (see Greedy)


@dataclass(frozen=True)
class Greedy:
    """transformers' greedy tokens of ``PROMPT`` and, per step, the gap between its best and second logit."""

    tokens: list[int]
    gaps: list[float]

    def matches(self, got: list[int], dtype: str) -> bool:
        """``got`` (the server's) is the same greedy sequence: equal, or equal up to a step where the two best
        logits tie within ``TIE[dtype]`` (vLLM's CPU kernels round otherwise than torch's; in bf16 this
        tiny random model's logits tie exactly at some steps — vLLM's own load of a checkpoint differs
        from transformers there too)."""
        for mine, theirs, gap in zip(got, self.tokens, self.gaps, strict=True):
            if mine != theirs:
                return gap <= TIE[dtype]
        return True


class HfTrainer(LineChild):
    """``_hf_trainer``: a transformers model published as HF names or Megatron TP shards."""

    def __init__(self, model_dir: pathlib.Path, *, layout: str = "hf", tp: int = 2, dtype: str = "float32",
                 serve_dtype: str | None = None, prompt: list[int] = PROMPT) -> None:  # fmt: skip
        spec = {"model_dir": str(model_dir), "layout": layout, "tp": tp, "dtype": dtype, "serve_dtype": serve_dtype,
                "prompt": prompt, "tokens": TOKENS}  # fmt: skip
        super().__init__([sys.executable, "-m", "tests.integrations._hf_trainer", json.dumps(spec)], path=[ROOT],
                         env={"OMP_NUM_THREADS": "1"})  # one core: the server shares this machine  # fmt: skip
        self.layout = layout

    async def __aenter__(self) -> Self:
        await super().__aenter__()
        self.registry = str((await self._ask(None))["registry"])
        return self

    async def publish(self, version: int, seed: int, **flags: bool | str) -> Greedy:
        answer = await self._ask({"version": version, "seed": seed, **flags})
        assert answer["published"] == version
        return Greedy(answer["expected"], answer["gaps"])

    async def publish_adapter(self, name: str, version: int, seed: int, *, base_version: int = 0,
                              **flags: bool | int) -> tuple[Greedy, list[int]]:  # fmt: skip
        """Version ``version`` of LoRA adapter ``name``: the PEFT model's greedy tokens, and those it would give
        had ``alpha / r`` been applied twice."""
        answer = await self._ask({"adapter": name, "version": version, "seed": seed, "base_version": base_version,
                                  **flags})  # fmt: skip
        assert answer["published"] == version
        return Greedy(answer["expected"], answer["gaps"]), answer["twice"]

    def init_info(self, **extra: Any) -> dict[str, Any]:
        fields = {"budget_bytes": 1 << 20} | extra
        info = RefitflowInitInfo(registry=self.registry, model="tiny-real", identity={"layout": self.layout}, **fields)
        return {"init_info": info.to_dict()}


def save(model: tf.PreTrainedModel, path: pathlib.Path) -> pathlib.Path:
    model.save_pretrained(path)
    return path


async def update(server: VllmServer, version: int, **info: Any) -> tuple[int, str]:
    """vLLM's own sequence, paused: start → update → finish (when the update succeeded) → resume.
    The update's status and body."""
    assert (await server.post("/pause?mode=keep")).status_code == 200
    assert (await server.post("/start_weight_update")).status_code == 200, "start refused"
    answer = await server.post("/update_weights", {"update_info": {"version": version, "timeout_s": 60, **info}})
    if answer.status_code == 200:
        finish = await server.post("/finish_weight_update", {"weight_version": str(version)})
        assert finish.status_code == 200, finish.text
    await server.post("/resume")
    return answer.status_code, answer.text


def bench_llama(path: pathlib.Path, *, hidden: int, layers: int) -> tuple[tf.LlamaConfig, int]:
    """The benches' Llama (vocabulary 8,000, GQA, untied head; hidden 512 and 4 layers: 80 MB fp32), seed 0,
    saved at ``path``: its config and its bytes in fp32."""
    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=8000, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                            num_hidden_layers=layers, num_attention_heads=hidden // 64,
                            num_key_value_heads=hidden // 128, max_position_embeddings=512,
                            tie_word_embeddings=False)  # fmt: skip
    model = tf.LlamaForCausalLM(config)
    save(model, path)
    return config, sum(p.numel() for p in model.parameters()) * 4


def llama_checkpoint(path: pathlib.Path) -> pathlib.Path:
    """A tiny Llama (untied head, GQA, vocabulary not a multiple of 64: vLLM pads it), seed 0."""
    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=200, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                            tie_word_embeddings=False)  # fmt: skip
    return save(tf.LlamaForCausalLM(config), path)


def mixtral_checkpoint(path: pathlib.Path) -> pathlib.Path:
    torch.manual_seed(0)
    config = tf.MixtralConfig(vocab_size=200, hidden_size=128, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                              num_experts_per_tok=2, max_position_embeddings=256,
                              tie_word_embeddings=False)  # fmt: skip
    return save(tf.MixtralForCausalLM(config), path)
