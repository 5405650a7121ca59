"""One engine of one rank in its own process, for the controller's fleet tests: a NIXL receiver that relays
what it holds (shadow mode), a one-rank vote and an ``EngineAgent`` on ``argv[3]``, against the registry at
``argv[2]``; ``argv[1]`` the model spec of ``tests.transports._nixl_peer.model``. It prints ``RF {"ready":
true}``, answers ``{"holds": seed}`` with ``RF {"holds": bool}`` (its tensors are that seed's model), and
ends when stdin closes."""

from __future__ import annotations

import json
import sys

import anyio
import anyio.to_thread
import torch

import refitflow as rf
from refitflow.engine.solo_vote import SoloVote
from tests.transports._nixl_peer import PREFIX, model


async def main() -> None:
    spec, registry, address = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
    dst = {n: torch.zeros_like(t) for n, t in model(spec, 0).items()}
    async with (
        rf.Receiver(dst, registry, identity=rf.Identity(model=spec["model"]), transport="nixl", mode="shadow",
                    serve_replicas=True, relay_bucket_bytes=64 * 1024, read_timeout_s=10.0) as recv,
        anyio.create_task_group() as tg,
    ):  # fmt: skip
        tg.start_soon(rf.EngineAgent(rf.EngineMember(recv, SoloVote(), vote_timeout=10), address).serve)
        print(PREFIX + json.dumps({"ready": True}), flush=True)
        while line := await anyio.to_thread.run_sync(sys.stdin.readline):
            expected = model(spec, json.loads(line)["holds"])
            holds = all(torch.equal(recv.destination.live(n), t) for n, t in expected.items())
            print(PREFIX + json.dumps({"holds": holds}), flush=True)
        tg.cancel_scope.cancel()


if __name__ == "__main__":
    anyio.run(main)
