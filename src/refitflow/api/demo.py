"""``refitflow demo``: publish several versions of a synthetic model and refit two receivers.

One trainer rank publishes; one receiver writes in place, one through a shadow copy. After every
version both must be bit-exact with the trainer; the demo prints GB/s and per-stage times, with a
plain ``copy_`` of the same bytes as the reference.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import anyio
import torch

from refitflow.api.publisher import Publisher
from refitflow.api.receiver import Receiver, RefitResult
from refitflow.api.registry import Registry
from refitflow.api.synthetic import synthetic_model
from refitflow.core.types import Identity

__all__ = ["DemoConfig", "run_demo"]

STAGES = ("discover", "plan", "allocate", "pull", "translate", "apply", "verify", "commit")


@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    size_bytes: int = 256 * 10**6
    versions: int = 3
    budget_bytes: int = 64 << 20
    transport: str = "loopback"


def _copy_gbps(tensors: dict[str, torch.Tensor]) -> float:
    """A plain one-thread ``copy_`` of the same bytes into warm memory (the reference)."""
    dst = {n: torch.empty_like(t) for n, t in tensors.items()}
    for _ in range(2):  # the first pass faults the pages in; time the second
        t0 = time.perf_counter()
        for n, t in tensors.items():
            dst[n].copy_(t)
        seconds = time.perf_counter() - t0
    return sum(t.nbytes for t in tensors.values()) / seconds / 1e9


def _stage_line(result: RefitResult) -> str:
    return "  ".join(f"{s} {result.stages[s].seconds * 1e3:7.1f}" for s in STAGES if s in result.stages)


async def run_demo(cfg: DemoConfig, out: object = print) -> bool:
    """Run the demo; True only if every receiver verified and committed every version bit-exactly."""
    say = out if callable(out) else print
    trainer = synthetic_model(cfg.size_bytes)
    nbytes = sum(t.nbytes for t in trainer.values())
    servers = {mode: {n: torch.zeros_like(t) for n, t in trainer.items()} for mode in ("in_place", "shadow")}
    registry = Registry()
    ident = Identity(model="demo-llama", dtype="bfloat16")
    say(f"refitflow demo: {len(trainer)} tensors, {nbytes / 1e9:.3f} GB bf16, {cfg.versions} versions, "
        f"transport={cfg.transport}, staging budget {cfg.budget_bytes / 2**20:.0f} MiB")  # fmt: skip
    say(f"reference: one-thread copy_ of the same bytes {_copy_gbps(trainer):.2f} GB/s")
    say(f"{'version':>7} {'receiver':>9} {'GB/s':>6} {'ms':>7}  per-stage busy ms")
    ok = True
    async with (
        Publisher(registry, identity=ident, transport=cfg.transport) as pub,
        Receiver(servers["in_place"], registry, identity=ident, transport=cfg.transport,
                 budget_bytes=cfg.budget_bytes, mode="in_place") as r_in,
        Receiver(servers["shadow"], registry, identity=ident, transport=cfg.transport,
                 budget_bytes=cfg.budget_bytes, mode="shadow") as r_sh,
    ):  # fmt: skip
        for version in range(1, cfg.versions + 1):
            if version > 1:
                await pub.released(version - 1, timeout=60)
                for t in trainer.values():  # a "training step": the tensors change in place
                    t.add_(0.25)
            await pub.publish(version, trainer)
            results: dict[str, RefitResult] = {}

            async def refit(name: str, recv: Receiver, v: int = version, out: dict = results) -> None:
                out[name] = await recv.refit(v, timeout=60)

            async with anyio.create_task_group() as tg:
                tg.start_soon(refit, "in_place", r_in)
                tg.start_soon(refit, "shadow", r_sh)
            for name, recv in (("in_place", r_in), ("shadow", r_sh)):
                r = results[name]
                exact = all(torch.equal(trainer[n], t) for n, t in recv.destination.params.items())
                ok &= exact and recv.status.committed_version == version
                say(f"{version:>7} {name:>9} {r.gbps:6.2f} {r.seconds * 1e3:7.1f}  {_stage_line(r)}"
                    + ("" if exact else "  MISMATCH"))  # fmt: skip
    say("all versions verified and committed on every receiver" if ok else "FAILED: a receiver is not exact")
    return ok
