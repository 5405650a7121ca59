"""A receiver in its own process (NIXL, shadow mode, serving replicas), driven over stdin/stdout.

Commands are JSON lines: ``{"refit": v, "seed": s}`` refits to version ``v`` and answers
``RF {"version", "nbytes", "exact"}`` (``exact``: bit-exact against ``model(spec, s)``);
``{"served": true}`` answers ``RF {"served": bytes peers read from this receiver}``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import anyio
import anyio.to_thread
import torch
from _nixl_peer import PREFIX, SRC, model
from anyio.abc import Process
from anyio.streams.buffered import BufferedByteReceiveStream

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


class ReceiverProc:
    """The test's handle on a receiver process running this file."""

    def __init__(self, spec: dict, registry: str) -> None:
        self.argv = [sys.executable, __file__, json.dumps(spec), registry]
        self.proc: Process | None = None

    async def __aenter__(self) -> ReceiverProc:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([SRC, os.path.dirname(__file__), *filter(None, [env.get("PYTHONPATH")])])
        env.setdefault("UCX_NET_DEVICES", "lo")
        self.proc = await anyio.open_process(self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None,
                                             env=env)  # fmt: skip
        assert self.proc.stdout is not None
        self._out = BufferedByteReceiveStream(self.proc.stdout)
        assert (await self._ask(None)) == {"ready": True}
        return self

    async def _ask(self, cmd: dict | None) -> dict:
        assert self.proc is not None and self.proc.stdin is not None
        if cmd is not None:
            await self.proc.stdin.send(json.dumps(cmd).encode() + b"\n")
        while True:
            line = (await self._out.receive_until(b"\n", 1 << 26)).decode()
            if line.startswith(PREFIX):
                return json.loads(line[len(PREFIX) :])

    async def refit(self, version: int, seed: int) -> dict:
        return await self._ask({"refit": version, "seed": seed})

    async def served(self) -> int:
        return int((await self._ask({"served": True}))["served"])

    async def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        await self.proc.wait()

    async def __aexit__(self, *exc: object) -> None:
        assert self.proc is not None
        with anyio.CancelScope(shield=True):
            if self.proc.returncode is None:
                assert self.proc.stdin is not None
                await self.proc.stdin.aclose()
                with anyio.move_on_after(10):
                    await self.proc.wait()
            if self.proc.returncode is None:
                await self.kill()
