"""A transformers trainer in its own process, publishing to a registry it serves, for a real vLLM server.

``argv[1]``: ``{"model_dir": d, "layout": "hf" | "megatron", "tp": n, "dtype": "float32" | "bfloat16",
"serve_dtype": ..., "prompt": [ids], "tokens": n}`` (``serve_dtype``: the server's, which the expected tokens
are computed in; default ``dtype``). The model is the transformers model saved in ``d`` (its config); it
prints ``RF {"ready": true}``, ``RF {"registry": address}``, then takes JSON lines on stdin:

- ``{"version": v, "seed": s}``: the weights of seed ``s`` (seed 0: the ones saved in ``d``, which the
  server booted from; another seed: a fresh initialisation), in ``dtype``, published as version ``v`` — HF
  names from one publisher, or Megatron's layout from ``tp`` publishers — answered with
  ``RF {"published": v, "expected": greedy tokens of the prompt, "gaps": [top-1 minus top-2 logit per step]}``
  (transformers' own ``generate``);
  ``"corrupt": true`` flips one byte of layer 0's attention after the digests were taken (``"lm_head"``:
  of the LM head, the last tensor);
  ``"widen": true`` publishes a model one head wider instead (another shape than the server's).

- ``{"adapter": name, "version": v, "seed": s, "base_version": b}``: a LoRA adapter (PEFT, ``LORA``: r 8, alpha
  32, every linear of the model) with random ``A`` and ``B`` of seed ``s``, on the base weights of
  ``"base_seed"`` (as ``seed`` above; default 0), published as version ``v`` of adapter ``name`` trained on
  base version ``b`` (``refitflow.integrations.lora``), answered like a version, with ``"twice"``: the greedy
  tokens had ``alpha / r`` been applied twice (a test's negative control); ``"corrupt": true`` flips one byte
  of it after the digests were taken.

Every rank writes the same registered tensors in place from version to version.
"""

from __future__ import annotations

import contextlib
import json
import sys
from typing import Any

import anyio
import anyio.to_thread
import torch
import transformers as tf

import refitflow as rf
from refitflow.layouts import Parallel, canonical_shapes, hf, megatron
from refitflow.layouts.canonical import from_canonical, to_canonical
from refitflow.layouts.wire import layout_metadata
from tests._keys import KEYS

PREFIX = "RF "


def weights(spec: dict[str, Any], seed: int, config: tf.PretrainedConfig) -> tf.PreTrainedModel:
    dtype = getattr(torch, spec["dtype"])
    if seed == 0:
        return tf.AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=dtype)
    torch.manual_seed(seed)
    return tf.AutoModelForCausalLM.from_config(config).to(dtype)


def expected(model: tf.PreTrainedModel, spec: dict[str, Any]) -> tuple[list[int], list[float]]:
    """The greedy tokens of the prompt, and at each step the gap between the best and the second-best logit
    (where it is tiny, another kernel's rounding may pick the other: the tests allow that, and only that)."""
    model = model.to(getattr(torch, spec.get("serve_dtype") or spec["dtype"]))
    prompt = torch.tensor([spec["prompt"]])
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=spec["tokens"], do_sample=False, min_new_tokens=spec["tokens"],
                             output_scores=True, return_dict_in_generate=True)  # fmt: skip
    gaps = [float(top[0] - top[1]) for top in (s[0].float().topk(2).values for s in out.scores)]
    return [int(t) for t in out.sequences[0, prompt.shape[1] :]], gaps


def ranks(spec: dict[str, Any], model: tf.PreTrainedModel) -> list[dict[str, torch.Tensor]]:
    """Each publisher rank's tensors: the HF state dict, or Megatron's TP shards."""
    if spec["layout"] == "hf":
        return [{n: t.detach().clone() for n, t in model.state_dict().items()}]
    d = hf.dims_from_config(model.config)
    canon = to_canonical([(hf.layout(d), model.state_dict())], canonical_shapes(d))
    return [from_canonical(megatron.layout(d, Parallel(tp=spec["tp"], tp_rank=r)), canon) for r in range(spec["tp"])]


def metadata(spec: dict[str, Any], config: tf.PretrainedConfig, rank: int) -> dict[str, str]:
    d = hf.dims_from_config(config)
    if spec["layout"] == "hf":
        return layout_metadata("hf", d, Parallel())
    return layout_metadata("megatron", d, Parallel(tp=spec["tp"], tp_rank=rank))


def victim(tensors: dict[str, torch.Tensor], which: bool | str) -> torch.Tensor:
    """The tensor a corrupted version flips a byte of: layer 0's attention, or the LM head."""
    if which == "lm_head":
        return next(t for n, t in tensors.items() if "lm_head" in n or "output_layer" in n)
    return next(t for n, t in tensors.items() if ".0." in n and ("q_proj" in n or "linear_qkv.weight" in n))


LORA = {"r": 8, "lora_alpha": 32, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                     "down_proj"]}  # fmt: skip


class Adapters:
    """The adapter commands: one ``AdapterPublisher`` per adapter name, on the boot checkpoint's model."""

    def __init__(self, spec: dict[str, Any], config: tf.PretrainedConfig, registry: Any,
                 stack: contextlib.AsyncExitStack) -> None:  # fmt: skip
        self.spec, self.config, self.registry, self.stack = spec, config, registry, stack
        self.publishers: dict[str, Any] = {}
        self.held: dict[str, dict[str, torch.Tensor]] = {}

    async def publish(self, cmd: dict[str, Any]) -> dict[str, Any]:
        import peft

        from refitflow.integrations.lora import AdapterPublisher

        base = weights(self.spec, cmd.get("base_seed", 0), self.config)  # the base version's weights
        model = peft.get_peft_model(base, peft.LoraConfig(**LORA, lora_dropout=0.0))
        gen = torch.Generator().manual_seed(cmd["seed"])
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
        name = cmd["adapter"]
        if name not in self.publishers:
            config = model.peft_config["default"].to_dict()
            self.publishers[name] = await self.stack.enter_async_context(
                AdapterPublisher(self.registry, name=name, config=config, transport="nixl"))  # fmt: skip
        fresh = {n: t.detach().clone() for n, t in peft.get_peft_model_state_dict(model).items()}
        held = self.held.setdefault(name, fresh)
        for n, t in fresh.items():
            held[n].copy_(t)
        await self.publishers[name].publish(cmd["version"], held, base_version=cmd["base_version"])
        if cmd.get("corrupt"):
            next(iter(held.values())).view(-1)[:1].view(torch.uint8)[0] ^= 0xFF
        tokens, gaps = expected(model, self.spec)
        for module in model.modules():  # the negative control: alpha / r applied twice
            if isinstance(getattr(module, "scaling", None), dict) and "default" in module.scaling:
                module.scaling["default"] *= LORA["lora_alpha"] / LORA["r"]
        twice, _ = expected(model, self.spec)
        return {"published": cmd["version"], "expected": tokens, "gaps": gaps, "twice": twice}


async def main() -> None:
    spec = json.loads(sys.argv[1])
    config = tf.AutoConfig.from_pretrained(spec["model_dir"])
    wide = tf.AutoConfig.from_pretrained(spec["model_dir"])
    wide.head_dim = config.hidden_size // config.num_attention_heads
    wide.num_attention_heads += config.num_key_value_heads  # more query heads: other q_proj / o_proj shapes
    world = 1 if spec["layout"] == "hf" else spec["tp"]
    identity = rf.Identity(model="tiny-real", layout=spec["layout"])
    held: list[dict[str, torch.Tensor]] = []
    async with (
        rf.Registry.serve("tcp://127.0.0.1:*", security=KEYS.server) as server,
        contextlib.AsyncExitStack() as stack,
    ):
        pubs = [
            await stack.enter_async_context(rf.Publisher(
                server.registry, identity=identity, rank=r, world_size=world, transport="nixl",
                metadata=metadata(spec, config, r),
            ))
            for r in range(world)
        ]  # fmt: skip
        adapters = Adapters(spec, config, server.registry, stack)
        print(PREFIX + json.dumps({"ready": True}), flush=True)
        print(PREFIX + json.dumps({"registry": server.address}), flush=True)
        while line := await anyio.to_thread.run_sync(sys.stdin.readline):
            cmd = json.loads(line)
            if "adapter" in cmd:
                print(PREFIX + json.dumps(await adapters.publish(cmd)), flush=True)
                continue
            if cmd.get("widen"):  # another model's shapes: fresh tensors, its layout announced
                model = weights(spec, cmd["seed"], wide)
                for rank, (pub, tensors) in enumerate(zip(pubs, ranks(spec, model), strict=True)):
                    pub.metadata = metadata(spec, wide, rank)
                    await pub.publish(cmd["version"], tensors)
                    pub.metadata = metadata(spec, config, rank)
                print(PREFIX + json.dumps({"published": cmd["version"], "expected": [], "gaps": []}), flush=True)
                continue
            model = weights(spec, cmd["seed"], config)
            fresh = ranks(spec, model)
            if not held:
                held = fresh
            for mine, new in zip(held, fresh, strict=True):
                for name, t in new.items():
                    mine[name].copy_(t)
            for pub, tensors in zip(pubs, held, strict=True):
                await pub.publish(cmd["version"], tensors)
            if cmd.get("corrupt"):
                victim(held[0], cmd["corrupt"]).view(-1)[:1].view(torch.uint8)[0] ^= 0xFF
            tokens, gaps = expected(model, spec)
            print(PREFIX + json.dumps({"published": cmd["version"], "expected": tokens, "gaps": gaps}), flush=True)


if __name__ == "__main__":
    anyio.run(main)
