"""A publisher or a receiver in its own process (NIXL), speaking to a registry service; driven over stdin.

``python _registry_children.py publisher ADDRESS [MODE]`` / ``receiver ADDRESS [HEARTBEAT_S]`` — commands are
JSON lines, each answered by one line ``RF <json>`` (``LineChild``):

- publisher: ``{"publish": v, "seed": s}`` writes ``model(s)`` into its tensors in place and publishes
  it as version ``v``; ``{"release": v}`` starts ``await pub.released(v)`` in the background;
  ``{"status": true}`` answers ``{"answering", "released": [versions released so far]}``.
- receiver: ``{"refit": v, "seed": s}`` refits to version ``v`` and answers ``{"version", "exact"}``
  (or ``{"error", "message"}``); ``{"status": true}`` answers ``{"answering", "announcements"}``.

Both clients time out requests after 1 s and heartbeat every 0.25 s (or HEARTBEAT_S), so an outage of a few seconds
is long next to them; the receiver re-asks the registry only every 60 s: within a test's deadline,
only an announcement wakes it.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator

import anyio
import anyio.to_thread
import torch

import refitflow as rf
from refitflow.registry.client.client import RegistryClient
from tests.transports._nixl_peer import PREFIX, LineChild

IDENTITY = rf.Identity(model="faults-registry")


def model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.weight": torch.randn(256 + i, generator=g) for i in range(8)}


def say(answer: dict) -> None:
    print(PREFIX + json.dumps(answer), flush=True)


async def _lines() -> AsyncIterator[str]:
    while line := await anyio.to_thread.run_sync(sys.stdin.readline):
        yield line


async def publisher(address: str, mode: str = "plain") -> None:
    """``mode``: ``plain``; ``early`` (two-phase publication); ``dies-after-announcing``: early, and the
    process exits (status 7) once its first layout is announced, before any digest — it answers
    ``{"announced": v}`` first."""
    if mode == "dies-after-announcing":
        import refitflow.api.publisher as publishing

        def die(*_: object) -> None:
            say({"announced": True})
            os._exit(7)

        publishing._digest_one_at_a_time = die  # type: ignore[assignment]
    client = RegistryClient(address, request_timeout_s=1.0, heartbeat_s=0.25)
    tensors = model(0)
    released: list[int] = []
    tasks: list[asyncio.Task[None]] = []

    async def release(pub: rf.Publisher, version: int) -> None:
        await pub.released(version, timeout=300)
        released.append(version)

    async with client, rf.Publisher(client, identity=IDENTITY, transport="nixl", announce_early=mode != "plain") as pub:
        say({"ready": True})
        async for line in _lines():
            cmd = json.loads(line)
            if "publish" in cmd:
                for name, t in model(cmd["seed"]).items():
                    tensors[name].copy_(t)
                await pub.publish(cmd["publish"], tensors)
                say({"published": cmd["publish"]})
            elif "release" in cmd:
                tasks.append(asyncio.create_task(release(pub, cmd["release"])))
                say({"releasing": cmd["release"]})
            else:
                say({"answering": client._channel.answering, "released": released})


async def receiver(address: str, heartbeat_s: str = "0.25") -> None:
    client = RegistryClient(address, request_timeout_s=1.0, heartbeat_s=float(heartbeat_s), requery_s=60)
    dst = {n: torch.zeros_like(t) for n, t in model(0).items()}
    async with client, rf.Receiver(dst, client, identity=IDENTITY, transport="nixl", mode="shadow",
                                   read_timeout_s=10.0, refit_timeout_s=60.0) as recv:  # fmt: skip
        say({"ready": True})
        async for line in _lines():
            cmd = json.loads(line)
            if "refit" not in cmd:
                say({"answering": client._channel.answering, "announcements": client.announcements,
                     "committed": recv.ledger.committed_version, "fence": recv.status.fence})  # fmt: skip
                continue
            try:
                result = await recv.refit(cmd["refit"], timeout=60)
            except rf.RefitError as exc:
                say({"error": type(exc).__name__, "message": str(exc)})
                continue
            exact = all(torch.equal(dst[n], t) for n, t in model(cmd["seed"]).items())
            say({"version": result.version, "exact": exact})


class RegistryChild(LineChild):
    """The test's handle on a publisher or receiver process running this file."""

    def __init__(self, role: str, address: str, *args: str) -> None:
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        super().__init__([sys.executable, os.path.abspath(__file__), role, address, *args], path=[root])

    async def ask(self, **cmd: object) -> dict:
        return await self._ask(cmd)


if __name__ == "__main__":
    anyio.run({"publisher": publisher, "receiver": receiver}[sys.argv[1]], *sys.argv[2:])
