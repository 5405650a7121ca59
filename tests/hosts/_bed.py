"""The multi-host test bed: a registry, a trainer and engine ranks, each a process in its own simulated host.

``Bed`` (an async context manager over ``_netns.Network``) starts ``refitflow registry`` on host ``reg``,
and ``trainer(host)`` / ``rank(host, engine, r, votes)`` processes running ``_role``. Every process runs
UCX on TCP over its host's ``eth0`` (``UCX_TLS=tcp``): left to choose, UCX sees the namespaces as one
node and reads across them by CMA, under the network — a partition would not stop a byte (measured: with
UCX's defaults every READ between "hosts" was ``cma/memory``). Each process logs UCX's protocol choices
(``UCX_PROTO_INFO``) to a file of the bed's; ``ucx_choices()`` reads them.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
from typing import Any, Self

import anyio

from tests.hosts._netns import Host, Network
from tests.registry._etcd import Cluster
from tests.transports._nixl_peer import LineChild

ROOT = pathlib.Path(__file__).resolve().parents[2]
REGISTRY_PORT = 7100


class Role(LineChild):
    """A ``_role`` process in a host; ``send`` a command, ``next`` answer (notices such as ``voted`` too)."""

    def __init__(self, host: Host, spec: dict[str, Any], log_dir: pathlib.Path) -> None:
        env = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth0", "UCX_PROTO_INFO": "y",
               "UCX_LOG_FILE": str(log_dir / "ucx.%p.log")}  # fmt: skip
        argv = host.argv([sys.executable, "-m", "tests.hosts._role", json.dumps(spec)])
        super().__init__(argv, path=[str(ROOT)], env=env)
        self.host = host

    async def send(self, cmd: dict[str, Any]) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        await self.proc.stdin.send(json.dumps(cmd).encode() + b"\n")

    async def next(self) -> dict[str, Any]:
        return await self._ask(None)

    async def ask(self, cmd: dict[str, Any]) -> dict[str, Any]:
        return await self._ask(cmd)


class Bed:
    """``etcd``: that many etcd members, each on a host of its own (``etcd1``…), and ``replicas`` registry
    replicas on them (hosts ``reg``, ``reg2``…; ``registry`` names them all); else one in-memory registry."""

    def __init__(self, log_dir: pathlib.Path, hosts: list[str], *, etcd: int = 0, replicas: int = 1) -> None:
        self.log_dir = log_dir
        self.net = Network()
        regs = ["reg"] + [f"reg{i}" for i in range(2, replicas + 1)]
        members = [f"etcd{i}" for i in range(1, etcd + 1)]
        self.hosts = {name: self.net.host(name) for name in [*regs, *members, *hosts]}
        self.replicas = [self.hosts[r].tcp(REGISTRY_PORT) for r in regs]
        self.registry = ",".join(self.replicas)
        self.registry_procs: list[subprocess.Popen[bytes]] = []
        self.etcd = Cluster(log_dir, [(self.hosts[m].address, self.hosts[m].argv) for m in members]) if etcd else None
        self.roles: list[Role] = []

    async def __aenter__(self) -> Self:
        if self.etcd is not None:
            self.etcd.start()
            await anyio.to_thread.run_sync(self.etcd.leader)
        for i in range(len(self.replicas)):
            await self.start_registry(i)
        return self

    async def start_registry(self, i: int) -> None:
        """Start replica ``i`` (again) on its host."""
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]))
        host = self.hosts["reg" if i == 0 else f"reg{i + 1}"]
        argv = [sys.executable, "-m", "refitflow", "registry", "--bind", self.replicas[i]]
        if self.etcd is not None:
            argv += ["--store", self.etcd.url, "--lease-s", "5"]
        proc = host.spawn(argv, stdout=subprocess.PIPE, env=env)
        assert proc.stdout is not None
        with anyio.fail_after(60):
            line = await anyio.to_thread.run_sync(proc.stdout.readline)
        assert b"serving at" in line, line
        self.registry_procs[i : i + 1] = [proc]

    def kill_registry(self, i: int) -> None:
        os.killpg(self.registry_procs[i].pid, signal.SIGKILL)
        self.registry_procs[i].wait(10)

    async def __aexit__(self, *exc: object) -> None:
        with anyio.CancelScope(shield=True):
            for role in reversed(self.roles):
                with anyio.move_on_after(15):
                    await role.__aexit__(*exc)
            if self.etcd is not None:
                self.etcd.close()
            self.net.close()
        assert not self.net.namespaces(), "a namespace of the test bed is left"

    async def start(self, host: str, spec: dict[str, Any]) -> Role:
        role = Role(self.hosts[host], {"registry": self.registry, "kind": "qwen2", **spec}, self.log_dir)
        self.roles.append(role)
        with anyio.fail_after(120):
            await role.__aenter__()
        return role

    async def trainer(self, host: str = "trainer", tp: int = 2) -> Role:
        return await self.start(host, {"role": "trainer", "tp": tp})

    async def engine(self, name: str, hosts: list[str], *, port: int, relay: bool = True,
                     **extra: Any) -> list[Role]:  # fmt: skip
        """The ranks of one engine, rank ``r`` on ``hosts[r]``, voting on ``port + r`` of their hosts."""
        votes = [self.hosts[h].tcp(port + r) for r, h in enumerate(hosts)]
        spec = {"role": "rank", "engine": name, "tp": len(hosts), "votes": votes, "relay": relay, **extra}
        ranks: list[Role] = []
        async with anyio.create_task_group() as tg:
            for r, h in enumerate(hosts):

                async def one(r: int = r, h: str = h) -> None:
                    ranks.append(await self.start(h, spec | {"rank": r}))

                tg.start_soon(one)
        return sorted(ranks, key=lambda role: json.loads(role.argv[-1])["rank"])

    def ucx_choices(self) -> set[str]:
        """Every transport/device UCX chose in any process of the bed (``tcp/eth0``, ``cma/memory``, ...),
        and whether a choice was for peers on the same node (``intra-node``) or another (``inter-node``)."""
        found: set[str] = set()
        for path in self.log_dir.glob("ucx.*.log"):
            text = path.read_text(errors="replace")
            found |= set(re.findall(r"\|\s*([a-z_0-9]+/[a-z_0-9]+)\s*\|", text))
            found |= set(re.findall(r"(intra-node|inter-node)", text))
        return found


async def refit_all(ranks: list[Role], version: int, timeout: float = 30.0) -> list[dict[str, Any]]:
    """Every rank refits ``version`` at once; their outcomes, in order."""
    out: list[dict[str, Any]] = [{}] * len(ranks)

    async def one(i: int) -> None:
        out[i] = await ranks[i].ask({"refit": version, "timeout": timeout})

    async with anyio.create_task_group() as tg:
        for i in range(len(ranks)):
            tg.start_soon(one, i)
    return out
