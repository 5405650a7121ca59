"""Real etcd clusters for tests: members as processes (``etcd`` from Debian's etcd-server package), on loopback
or one per simulated host (``tests.hosts._netns``). A missing ``etcd`` binary fails the test, saying how to
install it. ``Cluster.kill``/``start`` stop and restart one member on its data folder (SIGKILL: no goodbye);
``leader()`` asks the members which of them leads."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

INSTALL = "apt-get install etcd-server etcd-client (Debian's etcd 3.4)"


def require() -> None:
    for tool in ("etcd", "etcdctl"):
        if shutil.which(tool) is None:
            raise RuntimeError(f"`{tool}` is not installed: {INSTALL}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Member:
    name: str
    host: str  # the address it listens on
    client_port: int
    peer_port: int
    data: Path
    wrap: Callable[[list[str]], list[str]]  # runs argv where the member lives (a host's namespace, or as is)
    proc: subprocess.Popen[bytes] | None = None
    log: Path = field(init=False)

    def __post_init__(self) -> None:
        self.log = self.data.with_suffix(".log")

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://{self.host}:{self.peer_port}"


class Cluster:
    def __init__(self, root: Path, hosts: list[tuple[str, Callable[[list[str]], list[str]]]]) -> None:
        """``hosts``: (address, wrap) per member; on loopback every member gets its own ports."""
        require()
        self.members = []
        for i, (address, wrap) in enumerate(hosts):
            loop = address.startswith("127.")
            self.members.append(Member(
                f"e{i + 1}", address, free_port() if loop else 2379, free_port() if loop else 2380,
                root / f"etcd-e{i + 1}", wrap,
            ))  # fmt: skip
        self.initial = ",".join(f"{m.name}={m.peer_url}" for m in self.members)

    @property
    def url(self) -> str:
        return "etcd://" + ",".join(m.endpoint for m in self.members)

    def start(self, member: Member | None = None) -> None:
        for m in [member] if member is not None else self.members:
            argv = ["etcd", "--name", m.name, "--data-dir", str(m.data),
                    "--listen-client-urls", f"http://{m.endpoint}", "--advertise-client-urls", f"http://{m.endpoint}",
                    "--listen-peer-urls", m.peer_url, "--initial-advertise-peer-urls", m.peer_url,
                    "--initial-cluster", self.initial, "--initial-cluster-token", "refitflow-test",
                    "--heartbeat-interval", "100", "--election-timeout", "1000"]  # fmt: skip
            out = m.log.open("ab")
            m.proc = subprocess.Popen(m.wrap(argv), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            out.close()

    def kill(self, member: Member) -> None:
        if member.proc is not None and member.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(member.proc.pid, signal.SIGKILL)
            member.proc.wait(10)
        member.proc = None

    def status(self, member: Member) -> dict[str, Any] | None:
        cmd = member.wrap(["etcdctl", "--endpoints", member.endpoint, "--command-timeout=1s", "endpoint", "status",
                           "-w", "json"])  # fmt: skip
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
        if out.returncode != 0:
            return None
        found = json.loads(out.stdout)
        return found[0]["Status"] if found else None

    def leader(self, timeout: float = 30.0) -> Member:
        """The member that leads now (waits for an election)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for m in self.members:
                if m.proc is None:
                    continue
                st = self.status(m)
                if st is not None and st["header"]["member_id"] == st["leader"]:
                    return m
            time.sleep(0.2)
        raise RuntimeError(f"no etcd leader within {timeout} s; logs: {[str(m.log) for m in self.members]}")

    def close(self) -> None:
        for m in self.members:
            self.kill(m)


def loopback(root: Path, n: int = 1) -> Cluster:
    """``n`` members on 127.0.0.1, started; the caller closes it."""
    cluster = Cluster(root, [("127.0.0.1", lambda argv: argv)] * n)
    cluster.start()
    cluster.leader()
    return cluster
