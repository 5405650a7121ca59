"""``refitflow demo``: a registry, a trainer process publishing two ranks, and two receiver processes.

The trainer publishes a synthetic transformer-shaped bf16 model as world size 2 (each rank holds half
the rows of every matrix); one receiver refits in place, one through a shadow copy; several versions
in a row. Every receiver serves Prometheus metrics while it runs. The demo exits 0 only if every
receiver verified (every byte against the publisher's digests) and committed every version, with
the publisher's revision. With ``--transport loopback`` (in-process only) the roles run as tasks of
one process instead.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.to_thread

from refitflow.cli.demo_roles import RoleConfig, publisher_role, receiver_role, run_role_process
from refitflow.cli.demo_view import DemoView
from refitflow.cli.synthetic import synthetic_nbytes
from refitflow.registry.embedded import Registry

__all__ = ["DemoConfig", "run_demo", "run_processes"]

RECEIVERS = (("in_place", "in_place"), ("shadow", "shadow"))


@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    size_bytes: int = 10**9
    versions: int = 3
    budget_bytes: int = 256 << 20
    transport: str = "nixl"
    timeout_s: float = 300.0

    @property
    def roles(self) -> RoleConfig:
        return RoleConfig(size_bytes=self.size_bytes, versions=self.versions, budget_bytes=self.budget_bytes,
                          transport=self.transport, timeout_s=self.timeout_s)  # fmt: skip


def _handle(view: DemoView, event: dict[str, Any], nbytes: list[int]) -> None:
    kind = event["kind"]
    if kind == "publisher_ready":
        nbytes[0] = event["nbytes"]
        view.say(f"trainer: {event['tensors']} tensors, {event['nbytes'] / 1e9:.3f} GB bf16, 2 ranks")
    elif kind == "published":
        view.revisions[event["version"]] = event["revision"]
        view.say(f"v{event['version']} published (digests in {event['seconds'] * 1e3:.0f} ms)")
    elif kind == "receiver_ready":
        view.receiver_ready(event["name"], event["metrics_port"])
    elif kind == "progress":
        view.progress_event(event["name"], event["stage"], event["done"])
    elif kind == "refit":
        view.refit_event(event)
    elif kind == "error":
        view.say(f"[red]{event['role']} failed: {event['error']}[/red]")


async def run_demo(cfg: DemoConfig) -> bool:
    total = synthetic_nbytes(cfg.size_bytes)
    view = DemoView(total, cfg.versions)
    view.say(f"refitflow demo: {total / 1e9:.3f} GB model, {cfg.versions} versions, transport {cfg.transport}, "
             f"staging budget {cfg.budget_bytes / 2**20:.0f} MiB per receiver")  # fmt: skip
    t0 = time.perf_counter()
    with view:
        if cfg.transport == "loopback":
            await _in_process(cfg, view)
        else:
            await _processes(cfg, view)
    view.table()
    ok = view.ok([name for name, _ in RECEIVERS])
    view.say(f"{'all versions verified and committed on every receiver' if ok else 'FAILED'} "
             f"in {time.perf_counter() - t0:.1f} s")  # fmt: skip
    return ok


async def _in_process(cfg: DemoConfig, view: DemoView) -> None:
    registry, nbytes = Registry(), [0]

    def report(event: dict[str, Any]) -> None:
        _handle(view, event, nbytes)

    with anyio.fail_after(cfg.timeout_s):
        async with anyio.create_task_group() as tg:
            for name, mode in RECEIVERS:
                tg.start_soon(receiver_role, name, mode, registry, cfg.roles, report)
            tg.start_soon(publisher_role, registry, cfg.roles, len(RECEIVERS), report)


async def _processes(cfg: DemoConfig, view: DemoView) -> None:
    async with Registry.serve("tcp://127.0.0.1:*", lease_s=30) as server:
        roles: list[tuple[Any, tuple[Any, ...], str]] = [
            (publisher_role, (server.address, cfg.roles, len(RECEIVERS)), "publisher")
        ]
        roles += [(receiver_role, (name, mode, server.address, cfg.roles), name) for name, mode in RECEIVERS]
        nbytes = [0]
        await run_processes(roles, cfg.timeout_s, lambda event: _handle(view, event, nbytes))


async def run_processes(
    roles: list[tuple[Any, tuple[Any, ...], str]], timeout_s: float, on_event: Callable[[dict[str, Any]], None]
) -> None:
    """Run each role in a child process; pass on their events until all have exited (or one died)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=run_role_process, args=(run, args, label, queue)) for run, args, label in roles]
    for p in procs:
        p.start()
    running = len(procs)
    try:
        with anyio.fail_after(timeout_s):
            while running:
                event = await anyio.to_thread.run_sync(_get, queue, procs)
                if event is None:
                    raise RuntimeError("a process died without a word: " + _codes(procs))
                running -= event["kind"] == "exit"
                on_event(event)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


def _get(queue: Any, procs: list[Any]) -> dict[str, Any] | None:
    """The next event; None when nothing came for a while and some process is gone."""
    import queue as queue_mod

    while True:
        try:
            event: dict[str, Any] = queue.get(timeout=1.0)
            return event
        except queue_mod.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                return None


def _codes(procs: list[Any]) -> str:
    return ", ".join(f"{p.name}: exit {p.exitcode}" for p in procs)
