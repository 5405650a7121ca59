"""A receiver in its own process (NIXL, serving as a relay), driven over stdin/stdout.

Commands are JSON lines: ``{"refit": v, "seed": s, "frozen": k, "base": b}`` refits to version ``v`` and
answers ``RF {"version", "nbytes", "exact", "seconds", "relay_bytes", "rerouted_bytes", "skipped_bytes"}``
(``exact``: bit-exact against ``model(spec, s, frozen=k, base=b)``; with ``"later": true`` it is null and
``{"check": true}`` answers ``RF {"exact": …}`` for the last refit: making the expected model takes both cores
of a small machine for ≈ 0.1 s, which a benchmark keeps out of other receivers' refits); ``{"served": true}`` answers
``RF {"served": bytes peers read from this receiver}``; ``{"corrupt": name}`` changes one element of the
named tensor behind refitflow's back (in the storage it serves) and answers ``RF {"corrupt": name}``.

Options (a JSON object, the third argument): ``mode`` ("shadow"), ``serve`` (true), ``read_delay_s``
(0: each read waits this long first — a slow relay, made so on purpose), and receiver options.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Hashable, Sequence

import anyio
import anyio.to_thread
import torch
from _nixl_peer import PREFIX, LineChild, model

import refitflow as rf
from refitflow.transports.base import Read, Submitted
from refitflow.transports.nixl import NixlTransport


class SlowNixl(NixlTransport):
    """NIXL whose every read starts ``delay`` seconds late (a relay slower than its readers; real reads)."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay = delay

    async def read(self, reads: Sequence[Read], *, key: Hashable | None = None, count: bool = True) -> None:
        await anyio.sleep(self.delay)
        await super().read(reads, key=key, count=count)

    async def submit(self, reads: Sequence[Read], *, key: Hashable | None = None, count: bool = True) -> Submitted:
        await anyio.sleep(self.delay)  # the pull stage posts its reads without waiting: each post as late
        return await super().submit(reads, key=key, count=count)


def exact(spec: dict, dst: dict[str, torch.Tensor], cmd: dict) -> bool:
    """Whether ``dst`` holds, bit for bit, the model a refit command ``cmd`` names."""
    expected = model(spec, cmd["seed"], frozen=cmd.get("frozen", 0), base=cmd.get("base", 0))
    return all(torch.equal(dst[n], t) for n, t in expected.items())


async def main() -> None:
    spec, registry = json.loads(sys.argv[1]), sys.argv[2]
    options = {"mode": "shadow", "serve": True, "read_timeout_s": 10.0, "refit_timeout_s": 60.0}
    options |= json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    delay, serve = options.pop("read_delay_s", 0.0), options.pop("serve")
    dst = {n: torch.zeros_like(t) for n, t in model(spec, 0).items()}
    identity = rf.Identity(model=spec.get("model", "xproc"))
    transport: str | NixlTransport = SlowNixl(delay) if delay else "nixl"
    async with rf.Receiver(dst, registry, identity=identity, transport=transport, serve_replicas=serve,
                           **options) as recv:  # fmt: skip
        print(PREFIX + json.dumps({"ready": True}), flush=True)
        last: dict = {}
        while line := await anyio.to_thread.run_sync(sys.stdin.readline):
            cmd = json.loads(line)
            if cmd.get("served"):
                print(PREFIX + json.dumps({"served": recv._transport.served_bytes}), flush=True)  # type: ignore[union-attr]
                continue
            if "corrupt" in cmd:
                recv.destination.live(cmd["corrupt"])[7] += 1.0  # the storage it serves its committed version from
                print(PREFIX + json.dumps({"corrupt": cmd["corrupt"]}), flush=True)
                continue
            if cmd.get("check"):
                print(PREFIX + json.dumps({"exact": exact(spec, dst, last)}), flush=True)
                continue
            r = await recv.refit(cmd["refit"], timeout=20)
            last = cmd
            checked = None if cmd.get("later") else exact(spec, dst, cmd)
            print(PREFIX + json.dumps({
                "version": r.version, "nbytes": r.nbytes, "exact": checked, "seconds": r.seconds,
                "relay_bytes": r.relay_bytes, "rerouted_bytes": r.rerouted_bytes, "skipped_bytes": r.skipped_bytes,
                "stages": {k: [v.items, round(v.seconds, 4)] for k, v in r.stages.items()},
            }), flush=True)  # fmt: skip


if __name__ == "__main__":
    anyio.run(main)


class ReceiverProc(LineChild):
    """The test's handle on a receiver process running this file."""

    def __init__(self, spec: dict, registry: str, **options: object) -> None:
        argv = [sys.executable, __file__, json.dumps(spec), registry, json.dumps(options)]
        super().__init__(argv, path=[os.path.dirname(__file__)])

    async def refit(self, version: int, seed: int, frozen: int = 0, base: int = 0, later: bool = False) -> dict:
        """Refit to ``version``; ``later``: its ``exact`` is null, asked for by ``check``."""
        return await self._ask({"refit": version, "seed": seed, "frozen": frozen, "base": base, "later": later})

    async def check(self) -> bool:
        """Whether the last refit's destination is bit-exact (after ``refit(..., later=True)``)."""
        return bool((await self._ask({"check": True}))["exact"])

    async def corrupt(self, name: str) -> None:
        await self._ask({"corrupt": name})
