"""A Megatron-layout trainer in its own process: it serves a registry over ZMQ and publishes over NIXL.

``argv[1]``: ``{"kind": "qwen2"|"mixtral", "tp": n, "ep": n}``. It prints ``RF {"ready": true}`` and
``RF {"registry": address}``, then takes JSON lines on stdin: ``{"version": v, "seed": s, "corrupt": r}``
publishes version ``v`` of the tiny model (seed ``s``) from every Megatron rank (one publisher each,
writing the same registered tensors in place) and answers ``RF {"published": v}``. ``corrupt`` (a
Megatron rank, or null): the first byte of that rank's layer-0 QKV is flipped after its digests were taken.
"""

from __future__ import annotations

import contextlib
import json
import sys

import anyio
import anyio.to_thread
import torch

import refitflow as rf
from refitflow.layouts import Parallel, megatron
from refitflow.layouts.canonical import from_canonical
from refitflow.layouts.wire import layout_metadata
from tests._keys import KEYS
from tests.integrations._tiny import canonical, dims

PREFIX = "RF "
IDENTITY = rf.Identity(model="tiny-vllm", layout="megatron")
CORRUPT = "decoder.layers.0.self_attention.linear_qkv.weight"


async def main() -> None:
    spec = json.loads(sys.argv[1])
    d = dims(spec["kind"])
    tp, ep = spec.get("tp", 1), spec.get("ep", 1)
    places = [Parallel(tp=tp, tp_rank=r % tp, ep=ep, ep_rank=r // tp) for r in range(tp * ep)]
    shards: list[dict[str, torch.Tensor]] = []
    async with (
        rf.Registry.serve("tcp://127.0.0.1:*", security=KEYS.server) as server,
        contextlib.AsyncExitStack() as stack,
    ):
        pubs = [
            await stack.enter_async_context(rf.Publisher(
                server.registry, identity=IDENTITY, rank=r, world_size=len(places), transport="nixl",
                metadata=layout_metadata("megatron", d, p),
            ))
            for r, p in enumerate(places)
        ]  # fmt: skip
        print(PREFIX + json.dumps({"ready": True}), flush=True)
        print(PREFIX + json.dumps({"registry": server.address}), flush=True)
        while line := await anyio.to_thread.run_sync(sys.stdin.readline):
            cmd = json.loads(line)
            canon = canonical(spec["kind"], cmd["seed"])
            fresh = [from_canonical(megatron.layout(d, p), canon) for p in places]
            if not shards:
                shards = fresh
            else:
                for mine, new in zip(shards, fresh, strict=True):
                    for name, t in new.items():
                        mine[name].copy_(t)
            for pub, tensors in zip(pubs, shards, strict=True):
                await pub.publish(cmd["version"], tensors)
            if cmd.get("corrupt") is not None:
                shards[cmd["corrupt"]][CORRUPT].view(torch.uint8).view(-1)[0] ^= 0xFF
            print(PREFIX + json.dumps({"published": cmd["version"]}), flush=True)


if __name__ == "__main__":
    anyio.run(main)
