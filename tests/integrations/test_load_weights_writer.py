"""The ``load_weights`` writer over NIXL with buckets that share one window: a model whose tensors are larger
than each bucket's staging arena, in several buckets. Every bucket's views of the window overlap the
others', and NIXL finds no range among overlapping registrations (``NIXL_ERR_NOT_FOUND`` before the window
was registered once); both versions land bit-exactly through the model's own loader."""

from __future__ import annotations

import pathlib

import anyio
import pytest
import torch
import transformers as tf

from refitflow.core.errors import ConfigError
from refitflow.core.types import Identity
from refitflow.integrations.hosting.load_weights import load_weights_writer
from refitflow.integrations.hosting.rank_session import RankSession, SessionConfig
from tests._keys import KEYS
from tests.integrations._vllm_real import HfTrainer, save


def seeded(config: tf.PretrainedConfig, seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return dict(tf.AutoModelForCausalLM.from_config(config).state_dict())


@pytest.mark.asyncio
@pytest.mark.parametrize("read_start", [0.0, 0.5])
async def test_buckets_sharing_one_window_land_bit_exactly(tmp_path: pathlib.Path, read_start: float) -> None:
    """With ``read_start`` the buckets are read from the one that starts half-way through the bytes, wrapping
    round (rotating inside each bucket alone would leave every engine reading the same trainer ranks first)."""
    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=8000, hidden_size=1024, intermediate_size=2048, num_hidden_layers=2,
                            num_attention_heads=16, num_key_value_heads=4, tie_word_embeddings=False)  # fmt: skip
    model = tf.LlamaForCausalLM(config)
    live = dict(model.named_parameters())
    assert live["model.embed_tokens.weight"].nbytes > (8 << 20) // 4  # larger than a bucket's staging arena

    order: list[str] = []  # what load_weights was given, in order

    def load(weights: object) -> list[str]:
        names = []
        for name, tensor in weights:  # type: ignore[attr-defined]
            live[name].data.copy_(tensor)
            names.append(name)
        order.extend(names)
        return names

    with anyio.fail_after(300):
        async with HfTrainer(save(model, tmp_path / "model")) as trainer:
            config_ = SessionConfig(registry=trainer.registry, identity=Identity(model="tiny-real", layout="hf"),
                                    receiver_id="buckets", budget_bytes=8 << 20, keys=KEYS,
                                    receiver_options={"read_start": read_start})  # fmt: skip
            build = load_weights_writer(list(live.items()), load, "mlp")
            session = await anyio.to_thread.run_sync(RankSession.open, config_, build)
            try:
                for version in (1, 2):
                    await trainer.publish(version, seed=version)
                    order.clear()
                    await anyio.to_thread.run_sync(lambda v=version: session.update(v, timeout_s=60, wait_s=60))
                    assert await anyio.to_thread.run_sync(session.commit) == version
                    expected = seeded(config, version)
                    assert all(torch.equal(live[n].detach(), expected[n]) for n in live)
                    assert sorted(order) == sorted(live)  # each once
                    sizes = [live[n].nbytes for n in order]
                    before = sum(sizes[: order.index(next(iter(live)))])  # bytes loaded before the first tensor
                    if read_start:  # the first tensor comes after the buckets from half-way on
                        assert order[0] != next(iter(live)) and before >= sum(sizes) / 2 - (8 << 20), order
                    else:
                        assert before == 0
            finally:
                await anyio.to_thread.run_sync(session.close)
            bad = config_.__class__(**{**config_.__dict__, "receiver_options": {"read_start": 1.0}})
            with pytest.raises(ConfigError, match="read_start"):
                await anyio.to_thread.run_sync(RankSession.open, bad, build)
