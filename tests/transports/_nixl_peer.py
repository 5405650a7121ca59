"""A publisher in its own process, driven over stdin/stdout by ``test_nixl_xproc`` and the bench.

Commands are JSON lines on stdin: ``{"version": v, "seed": s}`` publishes ``model(spec, seed)`` as
version ``v`` (writing the same tensors in place, so their registrations stay; with ``"frozen": k`` the
first k tensors keep the values they have: a delta refit) and answers with a line
``RF <manifest as JSON>``; ``{"served": true}`` answers ``RF {"served": bytes peers read}``.
Lines not starting with ``RF `` are noise from libraries.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
from typing import Self

import anyio
import anyio.to_thread
import torch
from anyio.abc import Process
from anyio.streams.buffered import BufferedByteReceiveStream

import refitflow as rf
from refitflow.core.wire import manifest_from_dict, manifest_to_dict

PREFIX = "RF "
SRC = str(pathlib.Path(__file__).resolve().parents[2] / "src")


def model(spec: dict, seed: int, *, frozen: int = 0, base: int = 0) -> dict[str, torch.Tensor]:
    """``spec``: {"tensors": n, "numel": k}; float32 tensors of slightly varying sizes, seeded; the first
    ``frozen`` of them as in ``model(spec, base)``."""
    g = torch.Generator().manual_seed(seed)
    n, k = spec["tensors"], spec["numel"]
    out = {f"layers.{i}.weight": torch.randn(k + (i % 7), generator=g) for i in range(n)}
    if frozen:
        old = model(spec, base)
        out |= {name: old[name] for name in list(out)[:frozen]}
    return out


class LineRegistry:
    """Publishes by printing the manifest; every version counts as released (the test drives order)."""

    async def publish(self, manifest: rf.Manifest) -> None:
        print(PREFIX + json.dumps(manifest_to_dict(manifest)), flush=True)

    async def wait_released(
        self, identity: rf.Identity, version: int, timeout: float | None, *, policy: object = None
    ) -> None:
        return None

    async def is_released(self, identity: rf.Identity, version: int, *, policy: object = None) -> bool:
        return True

    async def acked(self, identity: rf.Identity, version: int) -> tuple[int, int]:
        return 0, 0


async def main() -> None:
    spec = json.loads(sys.argv[1])
    identity = rf.Identity(model=spec.get("model", "xproc"))
    tensors: dict[str, torch.Tensor] | None = None
    # one manifest a version on the line (the test feeds it to its registry): no two-phase publication
    async with rf.Publisher(LineRegistry(), identity=identity, transport="nixl", announce_early=False) as pub:
        print(PREFIX + json.dumps({"ready": True}), flush=True)
        while line := await anyio.to_thread.run_sync(sys.stdin.readline):
            cmd = json.loads(line)
            if cmd.get("served"):
                print(PREFIX + json.dumps({"served": pub._transport.served_bytes}), flush=True)  # type: ignore[union-attr]
                continue
            fresh = model(spec, cmd["seed"])
            if tensors is None:
                tensors = fresh
            else:
                for name in list(fresh)[cmd.get("frozen", 0) :]:
                    tensors[name].copy_(fresh[name])
            await pub.publish(cmd["version"], tensors)


if __name__ == "__main__":
    anyio.run(main)


class LineChild:
    """A test's handle on a child process speaking JSON lines: commands on stdin, ``RF <json>`` answers."""

    def __init__(self, argv: list[str], *, path: list[str] | None = None, env: dict[str, str] | None = None) -> None:
        self.argv, self.path, self.env = argv, path or [], env or {}
        self.proc: Process | None = None

    async def __aenter__(self) -> Self:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([SRC, *self.path, *filter(None, [env.get("PYTHONPATH")])])
        env.setdefault("UCX_NET_DEVICES", "lo")
        env.update(self.env)
        self.proc = await anyio.open_process(self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None,
                                             env=env)  # fmt: skip
        assert self.proc.stdout is not None
        self._out = BufferedByteReceiveStream(self.proc.stdout)
        assert (await self._ask(None)) == {"ready": True}
        return self

    async def _ask(self, cmd: dict | None) -> dict:
        """Send ``cmd`` (None: nothing) and return the next answer; other output lines are library noise."""
        assert self.proc is not None and self.proc.stdin is not None
        if cmd is not None:
            await self.proc.stdin.send(json.dumps(cmd).encode() + b"\n")
        while True:
            line = (await self._out.receive_until(b"\n", 1 << 26)).decode()
            if line.startswith(PREFIX):
                return json.loads(line[len(PREFIX) :])

    async def served(self) -> int:
        """Bytes peers have read from the child so far (its transport's ``served_bytes``)."""
        return int((await self._ask({"served": True}))["served"])

    async def kill(self) -> None:
        """SIGKILL the child and wait until it is gone."""
        assert self.proc is not None
        self.proc.kill()
        await self.proc.wait()

    async def __aexit__(self, *exc: object) -> None:
        assert self.proc is not None
        with anyio.CancelScope(shield=True):
            if self.proc.returncode is None:
                assert self.proc.stdin is not None
                await self.proc.stdin.aclose()  # end of commands: the child exits cleanly
                with anyio.move_on_after(10):
                    await self.proc.wait()
            if self.proc.returncode is None:
                await self.kill()


class Peer(LineChild):
    """The receiving side's handle on a publisher process running this file."""

    def __init__(self, spec: dict) -> None:
        super().__init__([sys.executable, __file__, json.dumps(spec)])

    async def publish(self, version: int, seed: int, frozen: int = 0) -> rf.Manifest:
        return manifest_from_dict(await self._ask({"version": version, "seed": seed, "frozen": frozen}))
