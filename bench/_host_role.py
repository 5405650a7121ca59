"""A role of ``bench/hosts_bench.py``, in its own process inside a simulated host (``tests/hosts/_netns``).

``argv[1]``: ``{"role": ..., "size_mb": n, "progress_s": s, ...}`` (``progress_s``: how often an idle data
owner's NIXL agent is progressed, ``NixlTransport(progress_interval_s=)``); it answers JSON lines on stdin
with ``RF <json>`` lines:

- ``trainer`` ``{"bind"}``: a registry and one NIXL publisher of a synthetic bf16 model; ``{"version": v}``
  publishes (new bytes each version) and answers when the digests are done; ``{"served": true}`` its
  egress so far; ``{"gloo": {"init", "world"}}`` joins a gloo group as rank 0 and broadcasts the model's
  tensors to it, ``rounds`` times, as a competent user would (one broadcast per tensor, in order);
- ``receiver`` ``{"registry", "name", "relay"}``: an ``rf.Receiver`` (in place, strict verify) refitting on
  ``{"refit": v}``, answering its seconds (found → committed) and bytes pulled;
- ``raw`` ``{"registry"}``: every shard of a version read straight into this process's tensors by
  ``NixlTransport.read`` — no plan, staging, verify or commit — ``{"raw": v, "rounds": k}`` answers the seconds;
- ``gloo`` ``{"init", "world", "rank"}``: receives the trainer's broadcasts into its tensors, answering each
  round's seconds.
"""

from __future__ import annotations

import datetime
import json
import sys
import time
from typing import Any

import anyio
import anyio.to_thread
import torch

import refitflow as rf
from refitflow.cli.synthetic import synthetic_model
from refitflow.registry.client.connect import connect_registry
from refitflow.transports.base import Read, as_bytes
from refitflow.transports.nixl import NixlTransport

IDENTITY = rf.Identity(model="hosts-bench")


def say(doc: dict[str, Any]) -> None:
    print("RF " + json.dumps(doc), flush=True)


async def lines() -> Any:
    while line := await anyio.to_thread.run_sync(sys.stdin.readline):
        yield json.loads(line)


def broadcast(tensors: list[torch.Tensor], init: str, world: int, rank: int, rounds: int) -> list[float]:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, world_size=world, rank=rank,
                            timeout=datetime.timedelta(seconds=300))  # fmt: skip
    try:
        seconds = []
        for _ in range(rounds):
            dist.barrier()
            t0 = time.perf_counter()
            for t in tensors:
                dist.broadcast(t, src=0)
            seconds.append(time.perf_counter() - t0)
        return seconds
    finally:
        dist.destroy_process_group()


async def trainer(spec: dict[str, Any]) -> None:
    size = spec["size_mb"] << 20
    model = synthetic_model(size, seed=0)
    transport = NixlTransport(progress_interval_s=spec["progress_s"])
    async with (  # open: the bench measures transfers between its simulated hosts
        rf.Registry.serve(spec["bind"], insecure=True) as server,
        rf.Publisher(server.registry, identity=IDENTITY, transport=transport) as pub,
    ):
        say({"ready": True})
        async for cmd in lines():
            if "version" in cmd:
                fresh = synthetic_model(size, seed=cmd["version"])
                for name, t in model.items():
                    t.copy_(fresh[name])
                await pub.publish(cmd["version"], model)
                say({"published": cmd["version"], "nbytes": sum(t.nbytes for t in model.values())})
            elif cmd.get("served"):
                say({"served": pub._transport.served_bytes})  # type: ignore[union-attr]
            elif "gloo" in cmd:
                g = cmd["gloo"]
                seconds = await anyio.to_thread.run_sync(broadcast, list(model.values()), g["init"], g["world"], 0,
                                                         g["rounds"])  # fmt: skip
                say({"seconds": seconds})


async def receiver(spec: dict[str, Any]) -> None:
    model = {n: torch.zeros_like(t) for n, t in synthetic_model(spec["size_mb"] << 20, seed=0).items()}
    transport = NixlTransport(progress_interval_s=spec["progress_s"])  # a relay is a data owner too
    async with rf.Receiver(model, spec["registry"], identity=IDENTITY, transport=transport, receiver_id=spec["name"],
                           serve_replicas=spec.get("relay", True), budget_bytes=64 << 20,
                           read_timeout_s=120) as recv:  # fmt: skip
        say({"ready": True})
        async for cmd in lines():
            result = await recv.refit(cmd["refit"], timeout=300)
            say({"version": result.version, "seconds": result.seconds, "nbytes": result.nbytes})


async def raw(spec: dict[str, Any]) -> None:
    model = {n: torch.zeros_like(t) for n, t in synthetic_model(spec["size_mb"] << 20, seed=0).items()}
    registry: Any = connect_registry(spec["registry"])
    transport = NixlTransport()
    for t in model.values():
        transport.register(t)
    try:
        say({"ready": True})
        async for cmd in lines():
            pub = await registry.wait_complete(IDENTITY, cmd["raw"], 300)
            reads = []
            for m in pub.manifests:
                transport.connect(m.source)
                reads += [Read(m.source.agent, s.region, s.offset, s.nbytes, as_bytes(model[s.name])) for s in m.shards]
            seconds = []
            for _ in range(cmd["rounds"]):
                t0 = time.perf_counter()
                await transport.read(reads, key="all")
                seconds.append(time.perf_counter() - t0)
            say({"seconds": seconds, "nbytes": sum(r.nbytes for r in reads)})
    finally:
        await transport.aclose()
        await registry.aclose()


async def gloo(spec: dict[str, Any]) -> None:
    model = {n: torch.zeros_like(t) for n, t in synthetic_model(spec["size_mb"] << 20, seed=0).items()}
    say({"ready": True})
    async for cmd in lines():
        seconds = await anyio.to_thread.run_sync(broadcast, list(model.values()), spec["init"], spec["world"],
                                                 spec["rank"], cmd["rounds"])  # fmt: skip
        say({"seconds": seconds})


def main() -> None:
    torch.set_num_threads(1)
    spec = json.loads(sys.argv[1])
    anyio.run({"trainer": trainer, "receiver": receiver, "raw": raw, "gloo": gloo}[spec["role"]], spec)


if __name__ == "__main__":
    main()
