"""What the RL-loop tests share: a tiny Llama and a word-level tokenizer made here (no download), a reward the
policy can learn (the share of completion tokens that are ``TARGET``), and the server's greedy tokens checked
against the trainer's current policy after a sync."""

from __future__ import annotations

import pathlib
from typing import Any

import httpx
import torch
import transformers as tf
from tokenizers import Tokenizer, models, pre_tokenizers

from tests.integrations._hf_trainer import expected
from tests.integrations._vllm_real import Greedy

VOCAB = 32  # vLLM pads it to 64 rows; a random policy samples TARGET about 1 token in 32
TARGET = 7
PROMPTS = ["w3 w5 w9", "w4 w6 w11", "w12 w13 w14", "w20 w2 w15"]
PROBE = [1, 17, 4, 9]  # the greedy check's prompt (token ids)
PROBE_TOKENS = 8


def tokenizer() -> tf.PreTrainedTokenizerFast:
    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2} | {f"w{i}": i for i in range(3, VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    out = tf.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>")
    out.padding_side = "left"
    return out


def checkpoint(path: pathlib.Path) -> pathlib.Path:
    """A tiny Llama (untied head, GQA; head_dim 32: vLLM's CPU attention refuses 16), seed 0, and its tokenizer,
    saved at ``path``."""
    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                            tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip
    tf.LlamaForCausalLM(config).save_pretrained(path)
    tokenizer().save_pretrained(path)
    return path


def target_share(completion_ids: list[list[int]], **_: Any) -> list[float]:
    """The reward: the share of each completion's tokens that are ``TARGET``."""
    return [sum(t == TARGET for t in ids) / max(1, len(ids)) for ids in completion_ids]


def server_greedy(url: str, tokens: int = PROBE_TOKENS) -> list[int]:
    body = {"model": "m", "prompt": PROBE, "max_tokens": tokens, "min_tokens": tokens, "temperature": 0.0,
            "return_token_ids": True}  # fmt: skip
    models_ = httpx.get(f"{url}/v1/models", timeout=60).json()
    body["model"] = models_["data"][0]["id"]
    answer = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    return list(answer.json()["choices"][0]["token_ids"])


def trainer_greedy(model: tf.PreTrainedModel, tokens: int = PROBE_TOKENS) -> Greedy:
    return Greedy(*expected(model, {"prompt": PROBE, "tokens": tokens, "dtype": "float32"}))


def weight_label(url: str) -> str:
    return str(httpx.get(f"{url}/weight_info", timeout=60).json()["weight_version"])


class Stream:
    """One greedy streaming generation of ``tokens`` tokens on ``/inference/v1/generate``; ``started`` is set at its
    first tokens; afterwards ``status``, ``count`` and vLLM's weight-version ``spans``."""

    def __init__(self, url: str, tokens: int) -> None:
        import anyio

        self.url, self.tokens = url, tokens
        self.started = anyio.Event()
        self.status: int | None = None
        self.count = 0
        self.spans: list[tuple[str, int, int]] = []

    async def run(self) -> None:
        import json

        sampling = {"temperature": 0.0, "max_tokens": self.tokens, "min_tokens": self.tokens}
        body = {"token_ids": PROBE, "stream": True, "sampling_params": sampling}
        async with httpx.AsyncClient(base_url=self.url, timeout=300) as http:
            async with http.stream("POST", "/inference/v1/generate", json=body) as answer:
                self.status = answer.status_code
                async for line in answer.aiter_lines():
                    if line.startswith("data: {"):
                        choice = json.loads(line[len("data: ") :])["choices"][0]
                        self.count += len(choice.get("token_ids") or [])
                        spans = choice.get("weight_versions")
                        if spans:
                            self.spans = [(s["version"], s["start"], s["end"]) for s in spans]
                        self.started.set()
