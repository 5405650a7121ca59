"""Fair slots: nine flooding sockets from one host (each up to its 128 requests in flight: 1,152, more than
the registry's 1,024) leave a client on another host served at once — the host's sockets share one quota of
half the slots. The registry, the flooder and the client each run on a simulated host of their own; the registry
keeps its state in memory, or in a one-member etcd cluster on a fourth host."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import subprocess
import sys

import anyio
import pytest

from tests.hosts._netns import network
from tests.registry._etcd import Cluster

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.asyncio
@pytest.mark.parametrize("store", ["memory", "etcd"])
async def test_many_sockets_from_one_host_leave_the_other_hosts_served(store: str, tmp_path: pathlib.Path) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]))
    with anyio.fail_after(120), network() as net, contextlib.ExitStack() as stack:
        reg, evil, good = net.host("reg"), net.host("evil"), net.host("good")
        address, flags = reg.tcp(7100), ["--open"]
        if store == "etcd":
            host = net.host("etcd1")
            cluster = Cluster(tmp_path, [(host.address, host.argv)])
            stack.callback(cluster.close)
            cluster.start()
            await anyio.to_thread.run_sync(cluster.leader)
            flags += ["--store", cluster.url]
        registry = reg.spawn([sys.executable, "-m", "refitflow", "registry", "--bind", address, *flags],
                             stdout=subprocess.PIPE, env=env)  # fmt: skip
        assert registry.stdout is not None
        assert b"serving at" in await anyio.to_thread.run_sync(registry.stdout.readline)
        flooder = evil.spawn([sys.executable, "-m", "tests.hosts._flood", "flood", address, "9"],
                             stdout=subprocess.PIPE, env=env)  # fmt: skip
        assert flooder.stdout is not None
        assert json.loads(await anyio.to_thread.run_sync(flooder.stdout.readline)) == {"flooding": True}
        asker = good.spawn([sys.executable, "-m", "tests.hosts._flood", "ask", address], stdout=subprocess.PIPE,
                           env=env)  # fmt: skip
        assert asker.stdout is not None
        answer = json.loads(await anyio.to_thread.run_sync(asker.stdout.readline))
        assert answer == {"served": True}, answer
