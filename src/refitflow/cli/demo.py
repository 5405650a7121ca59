"""``refitflow demo``: a registry, a trainer publishing as two ranks, and inference ranks refitting each version.

``--model tiny-llama`` (default): a tiny, randomly initialised transformers Llama; the trainer holds
it in Megatron's layout at TP 2 and takes a real optimiser step per version; two engines in vLLM's
fused layout (TP 1 in place, TP 2 shadow) refit it, each rank reading only its slice, and their
logits are checked against the trainer's after every version (``demo_model``).

``--model synthetic``: a synthetic transformer-shaped bf16 model of ``--size-mb``, published as two
row-sharded ranks into one in-place and one shadow receiver, for throughput (``demo_roles``).

Every receiving rank serves Prometheus metrics while it runs. The demo exits 0 only if every rank
verified (every byte against the publisher's digests) and committed every version, with the
publisher's revision (and, for the model, matching logits). With ``--transport loopback`` the roles
run as tasks of one process around an embedded registry; otherwise each runs in its own process
around a registry service, over NIXL.
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
from refitflow.core.errors import ConfigError
from refitflow.registry.keys import DeploymentKeys, server_of
from refitflow.registry.service.embedded import Registry

__all__ = ["MODELS", "TRANSPORTS", "DemoConfig", "run_demo", "run_processes"]

MODELS = ("tiny-llama", "synthetic")
TRANSPORTS = ("nixl", "loopback")
RECEIVERS = (("in_place", "in_place"), ("shadow", "shadow"))  # the synthetic model's receivers
Roles = list[tuple[Any, tuple[Any, ...], str]]  # (role, its arguments before ``report``, label)


@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    model: str = "tiny-llama"
    size_bytes: int = 10**9  # the synthetic model's size
    versions: int = 3
    budget_bytes: int = 256 << 20
    transport: str = "nixl"
    timeout_s: float = 300.0
    keys: DeploymentKeys | None = None  # CURVE on the registry service, every client and the engines' votes

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ConfigError(f"model must be one of {MODELS}, got {self.model!r}")
        if self.transport not in TRANSPORTS:
            raise ConfigError(f"transport must be one of {TRANSPORTS}, got {self.transport!r}")
        if self.versions < 1:
            raise ConfigError(f"versions must be at least 1, got {self.versions}")
        if self.size_bytes < 1 or self.budget_bytes < 64 or not self.timeout_s > 0:
            raise ConfigError("the model size, a budget of at least 64 bytes and the timeout must be positive")

    @property
    def roles(self) -> RoleConfig:
        return RoleConfig(size_bytes=self.size_bytes, versions=self.versions, budget_bytes=self.budget_bytes,
                          transport=self.transport, timeout_s=self.timeout_s, keys=self.keys)  # fmt: skip


def _roles(cfg: DemoConfig, registry: Any) -> Roles:
    if cfg.model == "synthetic":
        roles: Roles = [(publisher_role, (registry, cfg.roles, len(RECEIVERS)), "publisher")]
        return roles + [(receiver_role, (name, mode, registry, cfg.roles), name) for name, mode in RECEIVERS]
    from refitflow.cli.demo_model import ENGINES, engine_role, trainer_role

    ranks = sum(tp for _, tp, _ in ENGINES)
    roles = [(trainer_role, (registry, cfg.roles, ranks), "trainer")]
    return roles + [(engine_role, (name, tp, mode, registry, cfg.roles), name) for name, tp, mode in ENGINES]


def _view(cfg: DemoConfig) -> DemoView:
    if cfg.model == "synthetic":
        total = synthetic_nbytes(cfg.size_bytes)
        view = DemoView(cfg.versions, receivers=[name for name, _ in RECEIVERS])
        view.say(f"refitflow demo: synthetic {total / 1e9:.3f} GB bf16 model as 2 row-sharded trainer ranks, "
                 f"{cfg.versions} versions, receivers in_place and shadow, transport {cfg.transport}, "
                 f"staging budget {cfg.budget_bytes / 2**20:g} MiB per receiver")  # fmt: skip
        return view
    from refitflow.cli.demo_model import CONFIG, ENGINES, TRAIN_TP, model_nbytes

    ranks = [f"{name}/r{r}" if tp > 1 else name for name, tp, _ in ENGINES for r in range(tp)]
    view = DemoView(cfg.versions, receivers=ranks, engines=[name for name, _, _ in ENGINES])
    shape = ", ".join(f"{k.removeprefix('num_')}={v}" for k, v in CONFIG.items() if k != "tie_word_embeddings")
    engines = "; ".join(f"engine {n}: vLLM fused layout, TP {tp}, {mode}" for n, tp, mode in ENGINES)
    view.say(f"refitflow demo: tiny Llama ({shape}; {model_nbytes() / 1e6:.1f} MB bf16, random weights)\n"
             f"  trainer: Megatron layout, TP {TRAIN_TP} (2 publisher ranks), one optimiser step per version\n"
             f"  {engines}\n"
             f"  {cfg.versions} versions, transport {cfg.transport}, "
             f"staging budget {cfg.budget_bytes / 2**20:g} MiB per rank")  # fmt: skip
    return view


async def run_demo(cfg: DemoConfig) -> bool:
    """Run the demo; True when every rank verified and committed every version (and logits matched)."""
    if cfg.model != "synthetic":
        from refitflow.cli.demo_model import require_transformers

        require_transformers()
    view = _view(cfg)
    t0 = time.perf_counter()
    with view:
        if cfg.transport == "loopback":
            registry = Registry()
            with anyio.fail_after(cfg.timeout_s):
                async with anyio.create_task_group() as tg:
                    for role, args, _ in _roles(cfg, registry):
                        tg.start_soon(role, *args, view.handle)
        else:
            async with Registry.serve("tcp://127.0.0.1:*", lease_s=30, security=server_of(cfg.keys)) as server:
                await run_processes(_roles(cfg, server.address), cfg.timeout_s, view.handle)
    view.table()
    ok = view.ok()
    if cfg.transport != "loopback":
        view.say(
            f"CURVE on: keys in {cfg.keys.folder}" if cfg.keys else "OPEN: no authentication (REFITFLOW_KEYS=open)"
        )
    view.say(f"{'all versions verified and committed on every receiver' if ok else 'FAILED'} "
             f"in {time.perf_counter() - t0:.1f} s")  # fmt: skip
    return ok


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
