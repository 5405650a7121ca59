"""A receiver in its own process (NIXL, shadow mode, serving replicas), driven over stdin/stdout.

Commands are JSON lines: ``{"refit": v, "seed": s}`` refits to version ``v`` and answers
``RF {"version", "nbytes", "exact"}`` (``exact``: bit-exact against ``model(spec, s)``);
``{"served": true}`` answers ``RF {"served": bytes peers read from this receiver}``.
"""

from __future__ import annotations

import json
import os
import sys

import anyio
import anyio.to_thread
import torch
from _nixl_peer import PREFIX, LineChild, model

import refitflow as rf


async def main() -> None:
    spec, registry = json.loads(sys.argv[1]), sys.argv[2]
    dst = {n: torch.zeros_like(t) for n, t in model(spec, 0).items()}
    identity = rf.Identity(model=spec.get("model", "xproc"))
    async with rf.Receiver(dst, registry, identity=identity, transport="nixl", mode="shadow", serve_replicas=True,
                           read_timeout_s=10.0, refit_timeout_s=30.0) as recv:  # fmt: skip
        print(PREFIX + json.dumps({"ready": True}), flush=True)
        while line := await anyio.to_thread.run_sync(sys.stdin.readline):
            cmd = json.loads(line)
            if cmd.get("served"):
                print(PREFIX + json.dumps({"served": recv._transport.served_bytes}), flush=True)  # type: ignore[union-attr]
                continue
            result = await recv.refit(cmd["refit"], timeout=20)
            expected = model(spec, cmd["seed"])
            exact = all(torch.equal(dst[n], t) for n, t in expected.items())
            print(PREFIX + json.dumps({"version": result.version, "nbytes": result.nbytes, "exact": exact}), flush=True)


if __name__ == "__main__":
    anyio.run(main)


class ReceiverProc(LineChild):
    """The test's handle on a receiver process running this file."""

    def __init__(self, spec: dict, registry: str) -> None:
        super().__init__([sys.executable, __file__, json.dumps(spec), registry], path=[os.path.dirname(__file__)])

    async def refit(self, version: int, seed: int) -> dict:
        return await self._ask({"refit": version, "seed": seed})
