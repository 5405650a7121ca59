"""Simulated hosts: one Linux network namespace per host, all cabled to one switch, on one machine.

``Network`` makes a switch (a namespace of its own holding a bridge, so nothing touches the machine's own
network) and ``Network.host(name)`` a host: a namespace whose ``eth0`` is one end of a veth pair, the
other end plugged into the bridge, with an address from 198.18.0.0/15 (the benchmarking range) and no
route anywhere else. ``Host.spawn(argv)`` runs a process inside the host (``ip netns exec``);
``Host.partition()`` pulls its cable (the switch's end of its veth goes down: TCP to and from it stalls,
as on a real network — no reset), ``Host.heal()`` plugs it back. ``Network.close()`` kills every process
it started and removes every namespace and link; a namespace left by a killed run (same prefix) is removed
when the next ``Network`` is made. Needs root and iproute2 (``ip``): without them a test fails, saying so.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field

PREFIX = "rfh"  # every namespace a test bed makes starts with this
SUBNET = "198.18.0"  # /24 inside the switch; the run's namespaces isolate it from any other run


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True, timeout=30)


def require() -> str | None:
    """Why simulated hosts cannot be made here (None: they can)."""
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed (apt-get install iproute2)"
    if os.geteuid() != 0:
        return "network namespaces need root"
    return None


def _kill_inside(ns: str) -> None:
    for pid in _ip("netns", "pids", ns, check=False).stdout.split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep() -> None:
    """Remove namespaces (and their processes) an earlier, killed run left behind: this prefix, and a run whose
    process is gone — another run going on beside this one (another test worker, another checkout) keeps its own."""
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        if not name.startswith(PREFIX):
            continue
        digits = name[len(PREFIX) :].split("-", 1)[0]
        if digits.isdigit() and int(digits) != os.getpid() and _alive(int(digits)):
            continue  # a run still going (its pid is in the tag: PREFIX, pid, "-")
        _kill_inside(name)
        _ip("netns", "del", name, check=False)


@dataclass
class Host:
    network: Network
    name: str
    ns: str
    address: str
    cable: str  # the switch's end of this host's veth
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def argv(self, argv: list[str]) -> list[str]:
        """``argv`` run inside this host."""
        return ["ip", "netns", "exec", self.ns, *argv]

    def spawn(self, argv: list[str], **kwargs: object) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(self.argv(argv), start_new_session=True, **kwargs)  # type: ignore[call-overload]
        self.procs.append(proc)
        return proc

    def partition(self) -> None:
        """Pull the cable: nothing reaches this host or leaves it until ``heal``."""
        _ip("-n", self.network.switch, "link", "set", self.cable, "down")

    def heal(self) -> None:
        _ip("-n", self.network.switch, "link", "set", self.cable, "up")

    def tcp(self, port: int) -> str:
        return f"tcp://{self.address}:{port}"


class Network:
    def __init__(self) -> None:
        why = require()
        if why is not None:
            raise RuntimeError(f"simulated hosts cannot be made: {why}")
        sweep()
        self.tag = f"{PREFIX}{os.getpid()}-"  # sweep() reads the pid back
        self.switch = f"{self.tag}sw"
        self.hosts: list[Host] = []
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        _ip("-n", self.switch, "link", "set", "lo", "up")

    def host(self, name: str) -> Host:
        """A new host on the switch, named ``name`` (its address: the next one in the subnet)."""
        i = len(self.hosts) + 1
        ns, cable = f"{self.tag}{name}", f"p{i}"
        _ip("netns", "add", ns)
        _ip("-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", cable, "netns", self.switch)
        _ip("-n", self.switch, "link", "set", cable, "master", "br0")
        _ip("-n", self.switch, "link", "set", cable, "up")
        address = f"{SUBNET}.{i}"
        _ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        host = Host(self, name, ns, address, cable)
        self.hosts.append(host)
        return host

    def close(self) -> None:
        """Kill every process inside a host (those it started, and any other: ``ip netns pids``), then remove
        every namespace (their links go with them)."""
        for host in self.hosts:
            for proc in host.procs:
                if proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
            _kill_inside(host.ns)
            for proc in host.procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(10)
        for ns in [h.ns for h in self.hosts] + [self.switch]:
            _ip("netns", "del", ns, check=False)
        self.hosts = []

    def namespaces(self) -> list[str]:
        """This network's namespaces that exist now."""
        listed = _ip("netns", "list", check=False).stdout.split()
        return [n for n in listed if n.startswith(self.tag)]


@contextlib.contextmanager
def network() -> Iterator[Network]:
    net = Network()
    try:
        yield net
    finally:
        net.close()
