"""A highly available registry for tests: an etcd cluster on loopback and `refitflow registry --store etcd://…`
replicas as processes of their own (CURVE on, the deployment's keys in one folder), which a test stops
(SIGSTOP), kills (SIGKILL: no goodbye) and never restarts. ``Deployment.pair()`` gives two live replicas —
the first is the one every client uses first (clients try the replicas in the order given), to be killed —
spawning new ones for those killed before; so a module shares one cluster and its living replicas."""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

from refitflow.registry.keys import DeploymentKeys
from tests.registry._etcd import Cluster, loopback

SRC = str(Path(__file__).resolve().parents[2] / "src")
_CODE = "import sys; from refitflow.cli.registry_cmd import registry_main; sys.exit(registry_main(sys.argv[1:]))"


@dataclass
class Replica:
    proc: subprocess.Popen[bytes]
    address: str

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        """SIGSTOP: it keeps its connections and answers nothing (requests reach it and wait there)."""
        os.kill(self.proc.pid, signal.SIGSTOP)

    def kill(self) -> None:
        """SIGKILL, for good: its connections break, what it held in flight is lost."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)


def _banner(proc: subprocess.Popen[bytes], timeout: float) -> str:
    """The replica's first stdout line (its address), within ``timeout`` seconds."""
    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            raise AssertionError(f"a registry replica did not start within {timeout} s")
    line = proc.stdout.readline().decode()
    if " serving at " not in line:
        raise AssertionError(f"a registry replica did not start (rc {proc.poll()}): {line!r}")
    return line.split(" serving at ")[1].split()[0]


class Deployment:
    def __init__(self, root: Path, *, members: int = 3, lease_s: float = 3.0) -> None:
        self.root, self.lease_s = root, lease_s
        self.keys = DeploymentKeys.create(root / "keys", ("client", "trainer", "rollout", "operator"))
        self.namespace = uuid.uuid4().hex[:10]
        (root / "etcd").mkdir()
        self.etcd: Cluster = loopback(root / "etcd", members)
        self.replicas: list[Replica] = []

    def spawn(self, bind: str = "tcp://127.0.0.1:*") -> Replica:
        argv = [sys.executable, "-c", _CODE, "--bind", bind, "--store", self.etcd.url,
                "--namespace", self.namespace, "--lease-s", str(self.lease_s), "--keys", str(self.keys.folder)]
        env = {**os.environ, "PYTHONPATH": SRC}
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, env=env, start_new_session=True)
        try:
            replica = Replica(proc, _banner(proc, 60))
        except BaseException:
            Replica(proc, "").kill()
            raise
        self.replicas.append(replica)
        return replica

    def pair(self) -> tuple[Replica, Replica]:
        """Two live replicas: (the one to kill, the survivor)."""
        self.replicas = [r for r in self.replicas if r.alive]
        while len(self.replicas) < 2:
            self.spawn()
        return self.replicas[0], self.replicas[1]

    def owner_lease(self, owner: str) -> int | None:
        """The etcd lease that holds what ``owner`` (a client id) registered and published, or None (the registry
        names an owner by its id and its key: ``id@fingerprint``)."""
        key = f"/refitflow/{self.namespace}/o/{owner}@"
        out = subprocess.run(["etcdctl", "--endpoints", ",".join(m.endpoint for m in self.etcd.members),
                              "get", "--prefix", key, "-w", "json"], capture_output=True, text=True, timeout=20,
                             check=True)  # fmt: skip
        kvs = json.loads(out.stdout).get("kvs") or []
        return int(kvs[0]["lease"]) if kvs else None

    def close(self) -> None:
        for replica in self.replicas:
            replica.kill()
        self.replicas = []
        self.etcd.close()
