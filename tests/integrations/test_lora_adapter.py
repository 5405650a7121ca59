"""LoRA adapters as publications: a PEFT model's adapter published by two trainer ranks (``B`` split by rows, as
Megatron's column-parallel layers shard it), landed whole and verified as the PEFT directory PEFT itself writes,
refused when it is not for the base served, and never half-written (one process: an in-process registry and
the loopback transport; test_vllm_lora.py does it over NIXL into a real vLLM server)."""

from __future__ import annotations

import json
import pathlib

import anyio
import peft
import pytest
import torch
import transformers as tf
from safetensors.torch import load_file

import refitflow as rf
from refitflow.integrations.lora import AdapterPublisher, AdapterReceiver, adapter_identity, lora_name
from refitflow.integrations.lora.adapter import encode
from refitflow.integrations.lora.files import write

TARGETS = ["q_proj", "v_proj", "down_proj"]


def peft_model(seed: int, r: int = 4) -> peft.PeftModel:
    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    model = peft.get_peft_model(tf.LlamaForCausalLM(config), peft.LoraConfig(r=r, lora_alpha=16,
                                                                             target_modules=TARGETS))  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
    return model


def adapter_of(model: peft.PeftModel) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
    tensors = {n: t.detach().clone() for n, t in peft.get_peft_model_state_dict(model).items()}
    return tensors, model.peft_config["default"].to_dict()


def names(root: pathlib.Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def halves(tensors: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor | rf.Sharded]]:
    """Two ranks: every A on rank 0, each B split by rows between them."""
    ranks: list[dict[str, torch.Tensor | rf.Sharded]] = [{}, {}]
    for name, t in tensors.items():
        if ".lora_B." not in name:
            ranks[0][name] = t
            continue
        half = t.shape[0] // 2
        for r, (start, part) in enumerate([(0, t[:half]), (half, t[half:])]):
            ranks[r][name] = rf.Sharded(tensor=part.contiguous(), axis=0, start=start, global_shape=tuple(t.shape))
    return ranks


@pytest.mark.asyncio
async def test_an_adapter_lands_whole_as_the_peft_directory_peft_itself_writes(tmp_path: pathlib.Path) -> None:
    registry = rf.Registry()
    with anyio.fail_after(120):
        tensors, config = adapter_of(peft_model(seed=1))
        async with (
            AdapterPublisher(registry, name="policy", config=config, rank=0, world_size=2) as p0,
            AdapterPublisher(registry, name="policy", config=config, rank=1, world_size=2) as p1,
            AdapterReceiver(registry, receiver_id="rx") as rx,
        ):
            for pub, part in zip((p0, p1), halves(tensors), strict=True):
                await pub.publish(1, part, base_version=3)
            landed = await rx.receive("policy", 1, base_version=3, root=tmp_path)
            assert landed.name == lora_name("policy", 1) == "policy@v1" and landed.path == tmp_path / "policy@v1"
            on_disk = load_file(str(landed.path / "adapter_model.safetensors"))
            assert on_disk.keys() == tensors.keys()
            assert all(torch.equal(on_disk[n], t) for n, t in tensors.items())  # raw A and B: nothing scaled
            saved = json.loads((landed.path / "adapter_config.json").read_text())
            assert (saved["r"], saved["lora_alpha"], sorted(saved["target_modules"])) == (4, 16, sorted(TARGETS))
            # PEFT loads it back onto the base model as the same adapter
            again = peft.PeftModel.from_pretrained(peft_model(seed=2).get_base_model(), str(landed.path))
            assert all(torch.equal(a, b) for a, b in zip(peft.get_peft_model_state_dict(again).values(),
                                                         tensors.values(), strict=True))  # fmt: skip

            # version 2: another adapter; the newest `keep` versions stay on disk
            tensors2, _ = adapter_of(peft_model(seed=3))
            for version in (2, 3):
                for pub, part in zip((p0, p1), halves(tensors2 if version == 2 else tensors), strict=True):
                    await pub.publish(version, part, base_version=3)
                landed = await rx.receive("policy", version, base_version=3, root=tmp_path, keep=2)
            assert landed.pruned == (1,) and names(tmp_path) == ["policy@v2", "policy@v3"]
            assert torch.equal(load_file(str(tmp_path / "policy@v2" / "adapter_model.safetensors"))[
                next(iter(tensors2))], next(iter(tensors2.values())))  # fmt: skip


@pytest.mark.asyncio
async def test_an_adapter_for_another_base_a_superseded_one_or_a_corrupt_one_lands_nothing(
    tmp_path: pathlib.Path,
) -> None:
    registry = rf.Registry()
    with anyio.fail_after(120):
        tensors, config = adapter_of(peft_model(seed=1))
        async with (
            AdapterPublisher(registry, name="policy", config=config) as pub,
            AdapterReceiver(registry, receiver_id="rx") as rx,
        ):
            await pub.publish(1, tensors, base_version=5)
            with pytest.raises(rf.VersionError, match="trained on base version 5; this rank serves base version 4"):
                await rx.receive("policy", 1, base_version=4, root=tmp_path)
            await pub.publish(2, tensors, base_version=5)
            with pytest.raises(rf.VersionError, match="superseded by version 2"):
                await rx.receive("policy", 1, base_version=5, root=tmp_path)
            await pub.publish(3, tensors, base_version=5)
            next(iter(tensors.values())).view(-1)[0] += 1.0  # after its digests were taken
            with pytest.raises(rf.IntegrityError):
                await rx.receive("policy", 3, base_version=5, root=tmp_path)
            assert names(tmp_path) == []  # nothing written, not even a temporary directory
            next(iter(tensors.values())).view(-1)[0] -= 1.0
            await pub.publish(4, tensors, base_version=5)
            assert (await rx.receive("policy", 4, base_version=5, root=tmp_path)).path.is_dir()  # the next one lands


@pytest.mark.asyncio
async def test_what_is_not_an_adapter_is_refused_where_it_is_given(tmp_path: pathlib.Path) -> None:
    registry = rf.Registry()
    tensors, config = adapter_of(peft_model(seed=1))
    with pytest.raises(rf.ConfigError, match="r must be a positive integer"):
        AdapterPublisher(registry, name="policy", config={**config, "r": 0})
    with pytest.raises(rf.ConfigError, match="no '@'"):
        adapter_identity("policy@v1")
    async with AdapterPublisher(registry, name="policy", config=config) as pub:
        named = {n.replace(".lora_A.weight", ".lora_A.default.weight"): t for n, t in tensors.items()}
        with pytest.raises(rf.ConfigError, match="get_peft_model_state_dict"):
            await pub.publish(1, named, base_version=0)
    # a publication under the adapter's identity without the adapter's metadata
    async with (
        rf.Publisher(registry, identity=adapter_identity("bare")) as bare,
        AdapterReceiver(registry, receiver_id="rx") as rx,
    ):
        await bare.publish(1, tensors)
        with pytest.raises(rf.ManifestError, match="not all carry the same metadata"):
            await rx.receive("bare", 1, base_version=0, root=tmp_path)
    # a directory already there with other bytes for the same version: versions are never reused
    meta = json.loads(encode(config, 0)["lora"])["config"]
    write(tmp_path, "policy", 7, tensors, meta, revision="a")
    assert write(tmp_path, "policy", 7, tensors, meta, revision="a") == tmp_path / "policy@v7"  # a peer's: kept
    with pytest.raises(rf.VersionError, match="never reused"):
        write(tmp_path, "policy", 7, tensors, meta, revision="b")
