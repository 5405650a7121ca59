"""The synthetic demo's roles (a trainer process publishing two ranks, receiver processes refitting) and
what every demo role shares: progress metrics, refit events, the child-process entry point.

Roles are async functions that report events (plain dicts) through a callback, so the same code runs
as child processes (events over a multiprocessing queue) or as tasks of one process (loopback).

Timestamps that cross processes (the trainer's ``t_go``, a receiver's ``t_commit``) are
``time.monotonic()``: on Linux ``CLOCK_MONOTONIC``, one clock for every process of a host (not
stepped by NTP), so ``t_commit - t_go`` is the publish-to-commit time of a trainer and a receiver
on the same host. Peak RSS is each process's own (``peak_rss_bytes``).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import torch
import xxhash

from refitflow.api.publisher import Publisher, Sharded
from refitflow.api.receiver import Receiver, RefitResult
from refitflow.cli.synthetic import synthetic_model, synthetic_shapes
from refitflow.core.types import Identity, Manifest, Publication
from refitflow.engine.member import Preparer
from refitflow.metrics.prometheus import PrometheusMetrics
from refitflow.registry.keys import DeploymentKeys

__all__ = [
    "IDENTITY",
    "ProgressMetrics",
    "Report",
    "RoleConfig",
    "peak_rss_bytes",
    "publisher_role",
    "receiver_role",
    "refit_event",
    "run_role_process",
    "wait_for_receivers",
    "weights_digest",
]

IDENTITY = Identity(model="demo-llama", dtype="bfloat16", parallelism="tp2")
Report = Callable[[dict[str, Any]], None]


@dataclass(frozen=True, kw_only=True)
class RoleConfig:
    size_bytes: int
    versions: int
    budget_bytes: int
    transport: str
    timeout_s: float = 120.0
    device: str = "cpu"  # where the trainer's and the receivers' tensors live ("cuda:0": VRAM on both sides)
    receiver_device: str | None = None  # the receivers' device, when not ``device``
    shadow_commit: str = "swap"  # the shadow receiver's commit ("copy": CUDA-graph safe)
    announce_early: bool | None = None  # two-phase publication (None: auto, rf.Publisher): ranks publish at once
    keys: DeploymentKeys | None = None  # CURVE for every registry client and vote (None: open)

    def security(self, registry: Any) -> DeploymentKeys | None:
        """CURVE for a client of ``registry`` (an address; an embedded registry takes none): the key set, of which a
        publisher presents the trainer pair and a receiver the rollout pair."""
        return self.keys if isinstance(registry, str) else None


def _shards(model: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor | Sharded]:
    """Rank 0 and 1 each hold half the rows of every matrix (views, no copies); rank 0 the vectors."""
    out: dict[str, torch.Tensor | Sharded] = {}
    for name, t in model.items():
        if t.dim() < 2:
            if rank == 0:
                out[name] = t
            continue
        half = t.shape[0] // 2
        start, stop = (0, half) if rank == 0 else (half, t.shape[0])
        out[name] = Sharded(tensor=t[start:stop], axis=0, start=start, global_shape=tuple(t.shape))
    return out


async def publisher_role(registry: Any, cfg: RoleConfig, receivers: int, report: Report) -> None:
    model = synthetic_model(cfg.size_bytes, device=cfg.device)
    nbytes = sum(t.nbytes for t in model.values())
    async with (
        Publisher(registry, identity=IDENTITY, rank=0, world_size=2, transport=cfg.transport,
                  announce_early=cfg.announce_early, security=cfg.security(registry)) as p0,
        Publisher(registry, identity=IDENTITY, rank=1, world_size=2, transport=cfg.transport,
                  announce_early=cfg.announce_early, security=cfg.security(registry)) as p1,
    ):  # fmt: skip
        await wait_for_receivers(p0, receivers, cfg.timeout_s)
        report({"kind": "publisher_ready", "tensors": len(model), "nbytes": nbytes})
        for version in range(1, cfg.versions + 1):
            if version > 1:
                await p0.released(version - 1, timeout=cfg.timeout_s)
                for t in model.values():  # a training step changes the weights in place
                    t.add_(0.25)
            t_go = time.monotonic()  # the trainer's go: its digests count
            early = p0.announces_early
            manifests = await publish_all([p0, p1], [_shards(model, 0), _shards(model, 1)], version, at_once=early)
            revision = Publication(identity=IDENTITY, version=version, manifests=tuple(manifests)).revision
            report({"kind": "published", "version": version, "revision": revision, "t_go": t_go,
                    "seconds": time.monotonic() - t_go, "early": early})  # fmt: skip
        await p0.released(cfg.versions, timeout=cfg.timeout_s)
        report({"kind": "trainer_done", "rss": peak_rss_bytes(), "digest": weights_digest(model)})


async def publish_all(pubs: list[Publisher], shards: Sequence[Mapping[str, torch.Tensor | Sharded]], version: int, *,
                      at_once: bool) -> list[Manifest]:  # fmt: skip
    """Every rank's manifest of ``version``: one rank after the other, or all at once (as trainer processes
    would, each announcing its layout, then digesting: two-phase publication)."""
    if not at_once:
        return [await pub.publish(version, tensors) for pub, tensors in zip(pubs, shards, strict=True)]
    out: dict[int, Manifest] = {}

    async def one(rank: int) -> None:
        out[rank] = await pubs[rank].publish(version, shards[rank])

    async with anyio.create_task_group() as tg:
        for rank in range(len(pubs)):
            tg.start_soon(one, rank)
    return [out[rank] for rank in range(len(pubs))]


async def wait_for_receivers(pub: Publisher, receivers: int, timeout_s: float) -> None:
    """Until ``receivers`` receivers registered for the publisher's model (release waits only for those)."""
    with anyio.fail_after(timeout_s):
        while (await pub.registry.acked(pub.identity, 0))[1] < receivers:  # noqa: ASYNC110 (no event for it)
            await anyio.sleep(0.05)


def refit_event(name: str, result: RefitResult, recv: Preparer, committed: bool) -> dict[str, Any]:
    """What the display needs of one rank's refit."""
    return {
        "kind": "refit", "name": name, "version": result.version, "revision": result.revision,
        "gbps": result.gbps, "seconds": result.seconds, "nbytes": result.nbytes, "ideal_bytes": result.ideal_bytes,
        "skipped": result.skipped_bytes,
        "committed": committed and recv.ledger.committed_version == result.version
        and recv.ledger.fence.state == "ready",
        "peak_staging": result.peak_staging_bytes,
        "rss": peak_rss_bytes(),
        "stages": {k: v.seconds for k, v in result.stages.items()},
    }  # fmt: skip


def peak_rss_bytes() -> int:
    """This process's own peak resident set size (``VmHWM``; Linux).

    Not ``ru_maxrss``: a spawned child inherits its parent's high-water mark across fork and exec,
    while ``VmHWM`` belongs to the address space that exec creates.
    """
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # kB
    raise RuntimeError("/proc/self/status has no VmHWM line")


def weights_digest(model: dict[str, torch.Tensor]) -> str:
    """xxh3_64 of every tensor's name and bytes, in name order: equal on two sides means bit-exact."""
    h = xxhash.xxh3_64()
    for name in sorted(model):
        h.update(name.encode())
        h.update(model[name].detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


class ProgressMetrics(PrometheusMetrics):
    """Prometheus metrics that also report progress to the demo's display (throttled), and keep the
    current refit's timeline for the bench: when each stage was first entered and every transport
    read as (end, bytes, seconds), in ``time.monotonic()``, one clock for every process of the host."""

    def __init__(self, name: str, report: Report) -> None:
        super().__init__()
        self.name, self.report = name, report
        self.stage, self.last = "discover", 0.0
        self.new_refit()

    def new_refit(self) -> None:
        self.done = 0
        self.entered: dict[str, float] = {}
        self.reads: list[tuple[float, int, float]] = []

    def stage_enter(self, stage: str) -> None:
        super().stage_enter(stage)
        self.stage = stage
        self.entered.setdefault(stage, time.monotonic())

    def transport_read(self, transport: str, nbytes: int, seconds: float) -> None:
        super().transport_read(transport, nbytes, seconds)
        self.reads.append((time.monotonic(), nbytes, seconds))

    def stage_item(self, stage: str, nbytes: int, seconds: float) -> None:
        super().stage_item(stage, nbytes, seconds)
        if stage == "verify":
            self.done += nbytes
        now = time.monotonic()
        if now - self.last > 0.1:
            self.last = now
            self.report({"kind": "progress", "name": self.name, "stage": self.stage, "done": self.done})


async def receiver_role(name: str, mode: str, registry: Any, cfg: RoleConfig, report: Report) -> None:
    device = cfg.receiver_device or cfg.device
    model = {
        n: torch.zeros(s, dtype=torch.bfloat16, device=device) for n, s in synthetic_shapes(cfg.size_bytes).items()
    }
    metrics = ProgressMetrics(name, report)
    port = metrics.serve()
    commit = cfg.shadow_commit if mode == "shadow" else "swap"
    try:
        async with Receiver(
            model, registry, identity=IDENTITY, transport=cfg.transport, mode=mode,
            budget_bytes=cfg.budget_bytes, observer=metrics, shadow_commit=commit, security=cfg.security(registry),
        ) as recv:  # fmt: skip
            report({"kind": "receiver_ready", "name": name, "metrics_port": port,
                    "total": sum(t.nbytes for t in model.values())})  # fmt: skip
            for version in range(1, cfg.versions + 1):
                metrics.new_refit()
                txn, result = await recv.prepare(version, timeout=cfg.timeout_s)  # refit = prepare + finish
                t0 = time.monotonic()
                await recv.finish(txn)  # the commit: a swap, or the device copy of shadow_commit="copy"
                t_commit = time.monotonic()
                event = refit_event(name, result, recv, committed=True)
                event |= {"finish_seconds": t_commit - t0, "t_commit": t_commit,
                          "entered": metrics.entered, "reads": metrics.reads}  # fmt: skip
                if version == cfg.versions:  # after the timings: the bench checks these bytes against the trainer's
                    event["digest"] = weights_digest(model)
                report(event)
    finally:
        metrics.close()


def run_role_process(run: Callable[..., Awaitable[None]], args: tuple[Any, ...], label: str, queue: Any) -> None:
    """Entry point of a child process: run one role, send its events (and any failure) to the queue."""
    import logging

    logging.getLogger("nixl").setLevel(logging.WARNING)
    torch.set_num_threads(1)

    def report(event: dict[str, Any]) -> None:
        queue.put(event)

    try:
        anyio.run(functools.partial(run, *args, report=report))
    except BaseException as exc:
        queue.put({"kind": "error", "role": label, "error": f"{type(exc).__name__}: {exc}"})
        raise
    finally:
        queue.put({"kind": "exit", "role": label})
