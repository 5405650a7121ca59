"""A seeded soak: versions in a row with random faults from the matrix, over real processes.

    python -m bench.soak --seed 1 --versions 100 [--store etcd] [--replica-kill]

Processes: a registry service, a trainer (``rf.Publisher`` over NIXL), and a 2-rank engine (each
rank an ``rf.Receiver`` over NIXL writing in place, a ``ZmqVote`` and an ``EngineAgent``), driven
by an ``rf.Controller`` here. ``--store etcd``: the registry is two replicas on a 3-member etcd cluster
started here on loopback, every client given every replica's address (``_soak_registry``). Each version draws
one fault (or none):

- ``publisher_kill`` / ``publisher_stall``: SIGKILL / SIGSTOP (2 s) the trainer during the refit;
- ``registry_restart``: kill the registry service (every replica) and start it again on the same address;
- ``receiver_kill``: SIGKILL one rank during the refit, then start it again (fenced until it commits);
- ``byte_flip``: the trainer changes a byte of the version after publishing it;
- ``concurrent_refits``: two controller refits of the same version at once;
- ``replica_kill`` (etcd only; every version with ``--replica-kill``): SIGKILL the replica every client uses
  at a random moment from the publish on, never restarted during the version (a new replica in another slot
  before the next).

Counted, all of which must be 0 (or flat): ``hangs`` (a step past its deadline), ``mixed`` (two
ranks serving — fence ready — different versions), ``corrupt`` (a rank committed bytes that differ
from the version it names), ``release_stalls`` (a version every rank committed that the trainer's
``released(v)`` did not see released within ``RELEASE_S``; not asked after a ``receiver_kill``: the rank started
again is a new receiver, which holds the version until it read one), ``leaked_processes`` (children alive after the
end), ``crashes`` (a trainer, rank or registry replica that exited by itself: its exit status and the end of its
stderr; it is started again), and the growth of the fds and RSS of the processes that lived through the whole
run. ``committed`` counts versions every rank committed, ``outcomes`` each version's fault and whether it
committed, ``why`` what the ranks said of each version that did not. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import socket
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import torch
import xxhash

import refitflow as rf
from bench._soak_child import PREFIX, Child
from bench._soak_registry import Registries

IDENT = rf.Identity(model="soak")
FAULTS = ("publisher_kill", "publisher_stall", "registry_restart", "receiver_kill", "byte_flip", "concurrent_refits")
RELEASE_S = 10.0  # a version every rank committed is released within this (a lease is 3 s)


def weights(version: int) -> dict[str, torch.Tensor]:
    """The trainer's tensors at ``version`` (deterministic; bf16 into fp32 ranks: staged and cast).

    4 MB in 64 KiB of staging: a refit takes a while, so faults land inside it.
    """
    g = torch.Generator().manual_seed(version)
    return {f"layer{i}.weight": torch.randn(512, 512, generator=g).to(torch.bfloat16) for i in range(8)}


def digest(tensors: dict[str, torch.Tensor]) -> str:
    h = xxhash.xxh3_64()
    for name in sorted(tensors):
        h.update(tensors[name].detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


def say(**fields: Any) -> None:
    print(PREFIX + json.dumps(fields), flush=True)


# -- child roles ------------------------------------------------------------------------------------


async def registry_role(address: str, pub_address: str, store: str = "memory") -> None:
    async with contextlib.AsyncExitStack() as stack:
        state = None
        if store != "memory":
            from refitflow.registry.service.etcd.store import EtcdStore

            state = await stack.enter_async_context(EtcdStore.open(store, namespace="soak", lease_s=3.0))
        await stack.enter_async_context(rf.Registry.serve(address, pub_address=pub_address, lease_s=3.0,
                                                          registry=state))  # fmt: skip
        say(ready=True)
        await anyio.sleep_forever()


async def trainer_role(registry: str) -> None:
    async with rf.Publisher(registry, identity=IDENT, transport="nixl") as pub:
        held: dict[int, dict[str, torch.Tensor]] = {}
        say(ready=True)
        while line := await anyio.to_thread.run_sync(sys.stdin.readline):
            cmd = json.loads(line)
            if "released" in cmd:  # as a training loop asks before it changes a version's tensors
                t0 = time.perf_counter()
                try:
                    await pub.released(cmd["released"], timeout=RELEASE_S)
                    say(released=cmd["released"], ok=True, s=round(time.perf_counter() - t0, 2))
                except rf.RefitError as exc:
                    say(released=cmd["released"], ok=False, why=str(exc))
                continue
            version = cmd["publish"]
            tensors = held[version] = weights(version)
            with anyio.fail_after(20):
                await pub.publish(version, tensors)
            if cmd.get("flip"):
                tensors["layer1.weight"].view(-1).view(torch.uint8)[100] ^= 0x10  # changed under the receivers
            for old in [v for v in held if v < version - 2]:
                del held[old]  # the publisher keeps its newest versions' memory
            say(published=version)


class _Commits(rf.metrics.NullObserver):
    def __init__(self, params: dict[str, torch.Tensor]) -> None:
        self.params = params

    def refit_outcome(self, outcome: str, version: int | None) -> None:
        if outcome == "committed":
            say(committed=version, digest=digest(self.params))


async def rank_role(rank: int, registry: str, votes: str, agent: str) -> None:
    params = {n: torch.zeros(t.shape) for n, t in weights(0).items()}
    async with (
        rf.Receiver(
            params,
            registry,
            identity=IDENT,
            transport="nixl",
            observer=_Commits(params),
            budget_bytes=1 << 16,
            read_timeout_s=3.0,
            refit_timeout_s=20.0,
        ) as recv,  # fmt: skip
        rf.ZmqVote(rank, votes.split(","), settle_s=1.0) as channel,
    ):
        recv.ledger.fence_for_peers("started: no version yet")  # a fresh rank serves nothing
        member = rf.EngineMember(recv, channel, vote_timeout=5.0, resolve_timeout=1.0)
        say(ready=True)
        await rf.EngineAgent(member, agent, resolve_every_s=0.5).serve()


# -- the driver -------------------------------------------------------------------------------------


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


async def soak(seed: int, versions: int, faults: list[str] | None = None, *, store: str = "memory",
               replica_kill: bool = False) -> dict[str, Any]:  # fmt: skip
    """Run ``versions`` versions; ``faults``: the fault of each version (default: drawn with ``seed``; every
    version ``replica_kill`` with ``replica_kill``); ``store``: ``memory`` or ``etcd`` (a cluster started here)."""
    rng = random.Random(seed)
    plan = faults or [rng.choice(("none",) * 4 + FAULTS) for _ in range(versions)]
    if replica_kill:
        plan = ["replica_kill"] * len(plan)
    if "replica_kill" in plan and store != "etcd":
        raise ValueError("replica_kill needs replicas: --store etcd")
    with contextlib.ExitStack() as cleanup:
        url = "memory"
        if store == "etcd":
            from tests.registry._etcd import loopback

            root = Path(cleanup.enter_context(tempfile.TemporaryDirectory(prefix="soak-etcd-")))
            cluster = loopback(root, 3)
            cleanup.callback(cluster.close)
            url = cluster.url
        return await _run(rng, plan, Registries(url))


async def _run(rng: random.Random, plan: list[str], regs: Registries) -> dict[str, Any]:
    votes = ",".join(f"tcp://127.0.0.1:{_port()}" for _ in range(2))
    agents = [f"tcp://127.0.0.1:{_port()}" for _ in range(2)]
    counts = {"versions": len(plan), "committed": 0, "hangs": 0, "mixed": 0, "corrupt": 0, "release_stalls": 0,
              "leaked_processes": 0}  # fmt: skip
    counts |= {f: 0 for f in (*FAULTS, "replica_kill")} | {"outcomes": [], "release_s": [], "crashes": []}
    expected = {v: digest({n: t.float() for n, t in weights(v).items()}) for v in range(1, len(plan) + 1)}
    trainer = Child("trainer", regs.address)
    ranks = [Child("rank", str(r), regs.address, votes, agents[r]) for r in range(2)]
    controller = rf.Controller({"engine": agents}, slack_s=8.0)
    baseline: dict[str, Any] = {}
    async with anyio.create_task_group() as tg:
        try:
            await regs.start(tg)
            for child in (trainer, *ranks):
                await child.start(tg)
            for version, fault in enumerate(plan, start=1):
                if fault != "none":
                    counts[fault] += 1
                ok = await _one(tg, version, fault, rng, regs, trainer, ranks, controller, counts)
                counts["committed"] += ok
                counts["outcomes"].append(f"{version}:{fault}:{'committed' if ok else 'not'}")
                for child in (trainer, *ranks):  # a process that died by itself: counted, started again
                    if (how := child.crashed()) is not None:
                        counts["crashes"].append(f"{version}: {how}")
                        await child.start(tg)
                counts["crashes"] += [f"{version}: {how}" for how in regs.crashed()]  # refilled below
                status = (await controller.status(timeout=5.0))["engine"]
                ready = {s["committed_version"] for s in status if s is not None and s["fence"] == "ready"}
                counts["mixed"] += len(ready) > 1
                # the trainer never waits on a release that already happened; but a rank killed and started again
                # is a new receiver that has read nothing yet: it holds ``version`` (it must read it, or a newer
                # one) until the next refit, as it should
                if ok and fault != "receiver_kill":
                    await _released(trainer, version, counts)
                await regs.refill(tg)
                if version == 2 and regs.first is not None:  # after warm-up: the long-lived registry's fds, RSS
                    baseline = {"fds": _fds(regs.first.pid), "rss": _rss_mb(regs.first.pid)}
            for child in (*ranks, trainer):
                for m in child.lines:
                    if "committed" in m and m["digest"] != expected.get(m["committed"]):
                        counts["corrupt"] += 1
            if baseline and regs.first is not None:  # slot 0's registry (restarted on its address, or not)
                counts["registry_fd_growth"] = _fds(regs.first.pid) - baseline["fds"]
                counts["registry_rss_growth_mb"] = round(_rss_mb(regs.first.pid) - baseline["rss"], 1)
            counts["rank_fds"] = [_fds(r.pid) for r in ranks]
            counts["rank_rss_mb"] = [round(_rss_mb(r.pid), 1) for r in ranks]
        finally:
            with anyio.CancelScope(shield=True):
                with anyio.move_on_after(5):
                    await controller.stop_agents(timeout=3.0)
                for child in (*ranks, trainer):
                    await child.kill()
                await regs.kill()
            tg.cancel_scope.cancel()
    counts["leaked_processes"] = sum(_alive(pid) for child in (*regs.all, trainer, *ranks) for pid in child.pids)
    return counts


async def _released(trainer: Child, version: int, counts: dict[str, Any]) -> None:
    """Ask the trainer for ``released(version)`` (every rank committed it): a stall if not within ``RELEASE_S``."""
    await trainer.send({"released": version})
    if not await trainer.wait_line("released", version, RELEASE_S + 10):
        counts["release_stalls"] += 1
        counts.setdefault("stalled", []).append(f"{version}: no answer")
        return
    answer = next(m for m in reversed(trainer.lines) if m.get("released") == version)
    if answer["ok"]:
        counts["release_s"].append(answer["s"])  # from the engine's commit to released(v) returning
    else:
        counts["release_stalls"] += 1
        counts.setdefault("stalled", []).append(f"{version}: {answer['why']}")


async def _one(tg: anyio.abc.TaskGroup, version: int, fault: str, rng: random.Random, regs: Registries,
               trainer: Child, ranks: list[Child], controller: rf.Controller,
               counts: dict[str, Any]) -> bool:  # fmt: skip
    """One version under one fault; True when every rank committed it."""
    if fault == "registry_restart":
        await regs.restart(tg)
    results: list[dict[str, rf.EngineResult]] = []

    async def refit() -> None:
        with anyio.move_on_after(40) as scope:
            results.append(await controller.refit(version, timeout=8.0))
        counts["hangs"] += scope.cancelled_caught

    async def kill_replica(delay: float) -> None:
        await anyio.sleep(delay)
        await regs.kill_oldest()  # the replica every client uses; not restarted during this version

    async with anyio.create_task_group() as inner:
        if fault == "replica_kill":  # anywhere from the publish to past the commit
            inner.start_soon(kill_replica, rng.uniform(0.0, 1.5))
        await trainer.send({"publish": version, "flip": fault == "byte_flip"})
        if not await trainer.wait_line("published", version, 30):
            counts["hangs"] += 1  # (a registry the trainer cannot reach yet counts here)
            await trainer.kill()
            await trainer.start(tg)
            return False
        inner.start_soon(refit)
        if fault == "concurrent_refits":
            inner.start_soon(refit)
        await anyio.sleep(rng.uniform(0.0, 0.8))  # somewhere in the refit (or just before it)
        if fault == "publisher_kill":
            await trainer.kill()
        elif fault == "publisher_stall":
            trainer.signal(signal.SIGSTOP)
            await anyio.sleep(2.0)
            trainer.signal(signal.SIGCONT)
        elif fault == "receiver_kill":
            victim = ranks[rng.randrange(2)]
            await victim.kill()
    if fault == "publisher_kill":
        await trainer.start(tg)
    if fault == "receiver_kill":
        await victim.start(tg)
    ok = any(r["engine"].committed and r["engine"].version == version for r in results)
    if not ok:  # why, as the ranks said it: for whoever reads a failed run
        counts.setdefault("why", {})[str(version)] = [_why(r["engine"]) for r in results] or ["no answer"]
    return ok


def _why(result: rf.EngineResult) -> str:
    return "; ".join(f"rank {i}: {r.decision} {r.fence} {(r.error or '')[:160]}" for i, r in enumerate(result.ranks))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.soak")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--versions", type=int, default=100)
    parser.add_argument("--store", choices=("memory", "etcd"), default="memory",
                        help="the registry's state: one process in memory, or two replicas on a 3-member etcd cluster")
    parser.add_argument("--replica-kill", action="store_true",
                        help="(etcd) every version: the replica every client uses killed at a random moment, for good")
    parser.add_argument("--role", nargs="+")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.role:
        role, *rest = args.role
        roles = {"registry": registry_role, "trainer": trainer_role,
                 "rank": lambda r, *a: rank_role(int(r), *a)}  # fmt: skip
        anyio.run(roles[role], *rest)
        return 0
    if args.replica_kill and args.store != "etcd":
        parser.error("--replica-kill needs replicas: --store etcd")
    t0 = time.perf_counter()
    counts = anyio.run(partial(soak, args.seed, args.versions, store=args.store, replica_kill=args.replica_kill))
    counts["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(counts))
    bad = counts["hangs"] + counts["mixed"] + counts["corrupt"] + counts["leaked_processes"] + counts["release_stalls"]
    bad += len(counts["crashes"])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
