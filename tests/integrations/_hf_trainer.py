"""A transformers trainer in its own process, publishing to a registry it serves, for a real vLLM server.

``argv[1]``: ``{"model_dir": d, "layout": "hf" | "megatron", "tp": n, "dtype": "float32" | "bfloat16",
"prompt": [ids], "tokens": n}``. The model is the transformers model saved in ``d`` (its config); it
prints ``RF {"ready": true}``, ``RF {"registry": address}``, then takes JSON lines on stdin:

- ``{"version": v, "seed": s}``: the weights of seed ``s`` (seed 0: the ones saved in ``d``, which the
  server booted from; another seed: a fresh initialisation), in ``dtype``, published as version ``v`` — HF
  names from one publisher, or Megatron's layout from ``tp`` publishers — answered with
  ``RF {"published": v, "expected": greedy tokens of the prompt}`` (transformers' own ``generate``);
  ``"corrupt": true`` flips one byte of layer 0's attention after the digests were taken;
  ``"widen": true`` publishes a model one head wider instead (another shape than the server's).

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

PREFIX = "RF "


def weights(spec: dict[str, Any], seed: int, config: tf.PretrainedConfig) -> tf.PreTrainedModel:
    dtype = getattr(torch, spec["dtype"])
    if seed == 0:
        return tf.AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=dtype)
    torch.manual_seed(seed)
    return tf.AutoModelForCausalLM.from_config(config).to(dtype)


def expected(model: tf.PreTrainedModel, spec: dict[str, Any]) -> list[int]:
    prompt = torch.tensor([spec["prompt"]])
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=spec["tokens"], do_sample=False, min_new_tokens=spec["tokens"])
    return [int(t) for t in out[0, prompt.shape[1] :]]


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


def attention(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    return next(t for n, t in tensors.items() if ".0." in n and ("q_proj" in n or "linear_qkv" in n))


async def main() -> None:
    spec = json.loads(sys.argv[1])
    config = tf.AutoConfig.from_pretrained(spec["model_dir"])
    wide = tf.AutoConfig.from_pretrained(spec["model_dir"])
    wide.num_attention_heads += 1
    wide.head_dim = config.hidden_size // config.num_attention_heads
    world = 1 if spec["layout"] == "hf" else spec["tp"]
    identity = rf.Identity(model="tiny-real", layout=spec["layout"])
    held: list[dict[str, torch.Tensor]] = []
    async with rf.Registry.serve("tcp://127.0.0.1:*") as server, contextlib.AsyncExitStack() as stack:
        pubs = [
            await stack.enter_async_context(rf.Publisher(
                server.registry, identity=identity, rank=r, world_size=world, transport="nixl",
                metadata=metadata(spec, config, r),
            ))
            for r in range(world)
        ]  # fmt: skip
        print(PREFIX + json.dumps({"ready": True}), flush=True)
        print(PREFIX + json.dumps({"registry": server.address}), flush=True)
        while line := await anyio.to_thread.run_sync(sys.stdin.readline):
            cmd = json.loads(line)
            if cmd.get("widen"):  # another shape: fresh tensors, published as they are
                model = weights(spec, cmd["seed"], wide)
                for pub, tensors in zip(pubs, ranks(spec, model), strict=True):
                    await pub.publish(cmd["version"], tensors)
                print(PREFIX + json.dumps({"published": cmd["version"], "expected": []}), flush=True)
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
                attention(held[0]).view(-1)[:1].view(torch.uint8)[0] ^= 0xFF
            print(PREFIX + json.dumps({"published": cmd["version"], "expected": expected(model, spec)}), flush=True)


if __name__ == "__main__":
    anyio.run(main)
