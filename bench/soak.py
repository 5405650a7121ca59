"""A seeded soak: versions in a row with random faults from the matrix, over real processes.

    python -m bench.soak --seed 1 --versions 100

Processes: a registry service, a trainer (``rf.Publisher`` over NIXL), and a 2-rank engine (each
rank an ``rf.Receiver`` over NIXL writing in place, a ``ZmqVote`` and an ``EngineAgent``), driven
by an ``rf.Controller`` here. Each version draws one fault (or none):

- ``publisher_kill`` / ``publisher_stall``: SIGKILL / SIGSTOP (2 s) the trainer during the refit;
- ``registry_restart``: kill the registry service and start it again on the same address;
- ``receiver_kill``: SIGKILL one rank during the refit, then start it again (fenced until it commits);
- ``byte_flip``: the trainer changes a byte of the version after publishing it;
- ``concurrent_refits``: two controller refits of the same version at once.

Counted, all of which must be 0 (or flat): ``hangs`` (a step past its deadline), ``mixed`` (two
ranks serving — fence ready — different versions), ``corrupt`` (a rank committed bytes that differ
from the version it names), ``leaked_processes`` (children alive after the end), and the growth of
the fds and RSS of the processes that lived through the whole run. ``committed`` counts versions
every rank committed, ``outcomes`` each version's fault and whether it committed. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import torch
import xxhash
from anyio.abc import Process
from anyio.streams.buffered import BufferedByteReceiveStream

import refitflow as rf

PREFIX = "SOAK "
SRC = str(Path(__file__).resolve().parents[1] / "src")
ROOT = str(Path(__file__).resolve().parents[1])
IDENT = rf.Identity(model="soak")
FAULTS = ("publisher_kill", "publisher_stall", "registry_restart", "receiver_kill", "byte_flip", "concurrent_refits")


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


async def registry_role(address: str, pub_address: str) -> None:
    async with rf.Registry.serve(address, pub_address=pub_address, lease_s=3.0):
        say(ready=True)
        await anyio.sleep_forever()


async def trainer_role(registry: str) -> None:
    async with rf.Publisher(registry, identity=IDENT, transport="nixl") as pub:
        held: dict[int, dict[str, torch.Tensor]] = {}
        say(ready=True)
        while line := await anyio.to_thread.run_sync(sys.stdin.readline):
            cmd = json.loads(line)
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


class Child:
    """A role in its own process, speaking ``SOAK <json>`` lines on stdout."""

    def __init__(self, *args: str) -> None:
        self.args = args
        self.proc: Process | None = None
        self.pids: list[int] = []  # every process started for this role
        self.lines: list[dict[str, Any]] = []
        self._new = anyio.Event()  # set at each line

    async def start(self, tg: anyio.abc.TaskGroup) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([SRC, ROOT]))
        env.setdefault("UCX_NET_DEVICES", "lo")
        self.proc = await anyio.open_process([sys.executable, "-m", "bench.soak", "--role", *self.args],
                                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                             env=env)  # fmt: skip
        self.pids.append(self.proc.pid)
        ready = anyio.Event()
        tg.start_soon(self._read, self.proc, ready)
        with anyio.fail_after(60):
            await ready.wait()

    async def _read(self, proc: Process, ready: anyio.Event) -> None:
        assert proc.stdout is not None
        out = BufferedByteReceiveStream(proc.stdout)
        with contextlib.suppress(anyio.EndOfStream, anyio.IncompleteRead, anyio.ClosedResourceError):
            while True:
                line = (await out.receive_until(b"\n", 1 << 20)).decode()
                if line.startswith(PREFIX):
                    msg = json.loads(line[len(PREFIX) :])
                    if msg.get("ready"):
                        ready.set()
                    self.lines.append(msg)
                    self._new.set()
                    self._new = anyio.Event()

    async def send(self, cmd: dict[str, Any]) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        await self.proc.stdin.send(json.dumps(cmd).encode() + b"\n")

    async def wait_line(self, key: str, value: Any, timeout: float) -> bool:
        with anyio.move_on_after(timeout):
            while not any(m.get(key) == value for m in self.lines):
                await self._new.wait()
            return True
        return False

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.returncode is None:
            os.kill(self.proc.pid, sig)

    async def kill(self) -> None:
        if self.proc is not None:
            if self.proc.returncode is None:
                self.proc.kill()
            with anyio.CancelScope(shield=True):
                await self.proc.wait()

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid


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


async def soak(seed: int, versions: int, faults: list[str] | None = None) -> dict[str, Any]:
    """Run ``versions`` versions; ``faults``: the fault of each version (default: drawn with ``seed``)."""
    rng = random.Random(seed)
    plan = faults or [rng.choice(("none",) * 4 + FAULTS) for _ in range(versions)]
    registry = f"tcp://127.0.0.1:{_port()}"
    pub_address = f"tcp://127.0.0.1:{_port()}"
    votes = ",".join(f"tcp://127.0.0.1:{_port()}" for _ in range(2))
    agents = [f"tcp://127.0.0.1:{_port()}" for _ in range(2)]
    counts = {"versions": len(plan), "committed": 0, "hangs": 0, "mixed": 0, "corrupt": 0, "leaked_processes": 0}
    counts |= {f: 0 for f in FAULTS} | {"outcomes": []}
    expected = {v: digest({n: t.float() for n, t in weights(v).items()}) for v in range(1, len(plan) + 1)}
    reg = Child("registry", registry, pub_address)
    trainer = Child("trainer", registry)
    ranks = [Child("rank", str(r), registry, votes, agents[r]) for r in range(2)]
    controller = rf.Controller({"engine": agents}, slack_s=8.0)
    baseline: dict[str, float] = {}
    async with anyio.create_task_group() as tg:
        try:
            for child in (reg, trainer, *ranks):
                await child.start(tg)
            for version, fault in enumerate(plan, start=1):
                if fault != "none":
                    counts[fault] += 1
                ok = await _one(tg, version, fault, rng, reg, trainer, ranks, controller, counts)
                counts["committed"] += ok
                counts["outcomes"].append(f"{version}:{fault}:{'committed' if ok else 'not'}")
                status = (await controller.status(timeout=5.0))["engine"]
                ready = {s["committed_version"] for s in status if s is not None and s["fence"] == "ready"}
                counts["mixed"] += len(ready) > 1
                if version == 2:  # after warm-up: the fds and RSS of the long-lived processes
                    baseline = {"fds": _fds(reg.pid), "rss": _rss_mb(reg.pid)}
            for child in (*ranks, trainer):
                for m in child.lines:
                    if "committed" in m and m["digest"] != expected.get(m["committed"]):
                        counts["corrupt"] += 1
            if baseline:
                counts["registry_fd_growth"] = _fds(reg.pid) - baseline["fds"]
                counts["registry_rss_growth_mb"] = round(_rss_mb(reg.pid) - baseline["rss"], 1)
            counts["rank_fds"] = [_fds(r.pid) for r in ranks]
            counts["rank_rss_mb"] = [round(_rss_mb(r.pid), 1) for r in ranks]
        finally:
            with anyio.CancelScope(shield=True):
                with anyio.move_on_after(5):
                    await controller.stop_agents(timeout=3.0)
                for child in (*ranks, trainer, reg):
                    await child.kill()
            tg.cancel_scope.cancel()
    counts["leaked_processes"] = sum(_alive(pid) for child in (reg, trainer, *ranks) for pid in child.pids)
    return counts


async def _one(tg: anyio.abc.TaskGroup, version: int, fault: str, rng: random.Random, reg: Child, trainer: Child,
               ranks: list[Child], controller: rf.Controller, counts: dict[str, Any]) -> bool:  # fmt: skip
    """One version under one fault; True when every rank committed it."""
    if fault == "registry_restart":
        await reg.kill()
        await reg.start(tg)
    await trainer.send({"publish": version, "flip": fault == "byte_flip"})
    if not await trainer.wait_line("published", version, 30):
        counts["hangs"] += 1  # (a registry the trainer cannot reach yet counts here)
        await trainer.kill()
        await trainer.start(tg)
        return False
    results: list[dict[str, rf.EngineResult]] = []

    async def refit() -> None:
        with anyio.move_on_after(40) as scope:
            results.append(await controller.refit(version, timeout=8.0))
        counts["hangs"] += scope.cancelled_caught

    async with anyio.create_task_group() as inner:
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
    return any(r["engine"].committed and r["engine"].version == version for r in results)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.soak")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--versions", type=int, default=100)
    parser.add_argument("--role", nargs="+")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.role:
        role, *rest = args.role
        roles = {"registry": registry_role, "trainer": trainer_role,
                 "rank": lambda r, *a: rank_role(int(r), *a)}  # fmt: skip
        anyio.run(roles[role], *rest)
        return 0
    t0 = time.perf_counter()
    counts = anyio.run(soak, args.seed, args.versions)
    counts["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(counts))
    bad = counts["hangs"] + counts["mixed"] + counts["corrupt"] + counts["leaked_processes"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
