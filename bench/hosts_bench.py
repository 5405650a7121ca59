"""Cross-host refits over TCP, measured on simulated hosts (network namespaces on one machine, veth cables
through one bridge: ``tests/hosts/_netns``; needs root and iproute2).

    python bench/hosts_bench.py [--size-mb 256] [--rounds 3]

A trainer host (registry and one NIXL publisher of a synthetic bf16 model) and four receiver hosts, UCX on
TCP over each host's ``eth0`` (``UCX_TLS=tcp``), same run:

- **refitflow**: one receiver (in place, strict verify, no relay) refits a new version per round; its
  seconds are ``RefitResult.seconds`` (found → committed, verify included);
- **raw NIXL READ over TCP**: every shard's bytes read straight into a receiver's tensors by the same
  transport, nothing else (no plan, staging, verify, commit): the transport's limit;
- **gloo broadcast over TCP**: the trainer process joins a gloo group with one receiver and broadcasts the
  same tensors, one broadcast per tensor (as a competent user would; the trainer's digest time is not
  counted on either side);
- **fan-out**: four receivers (relaying) refit one new version together: the trainer's egress in model
  copies, the slowest receiver against the lone one.

Figures are GB/s (10^9 bytes a second) of the model's bytes; medians of ``--rounds``; the load average is
printed (a shared machine is noisy; the egress copies are not).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
from typing import Any

import anyio

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.hosts._netns import Host, network  # noqa: E402
from tests.transports._nixl_peer import LineChild  # noqa: E402

UCX = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth0", "GLOO_SOCKET_IFNAME": "eth0"}  # TCP on the host's cable


def role(host: Host, spec: dict[str, Any], env: dict[str, str]) -> LineChild:
    argv = host.argv([sys.executable, "-m", "bench._host_role", json.dumps(spec)])
    return LineChild(argv, path=[str(ROOT)], env=UCX | env)


async def ask(child: LineChild, cmd: dict[str, Any]) -> dict[str, Any]:
    return await child._ask(cmd)


def gbps(nbytes: int, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:.2f} GB/s ({seconds * 1e3:.0f} ms)"


async def run(args: argparse.Namespace) -> None:
    env = dict(kv.split("=", 1) for kv in args.env)
    if env:
        print(f"environment: {env}")
    with network() as net:
        hosts = [net.host(n) for n in ("trainer", "h1", "h2", "h3", "h4")]
        t = hosts[0]
        base = {"size_mb": args.size_mb, "progress_s": args.progress_us * 1e-6}
        registry = t.tcp(7100)
        async with role(t, base | {"role": "trainer", "bind": registry}, env) as trainer:
            version = 1
            nbytes = (await ask(trainer, {"version": version}))["nbytes"]
            print(f"model: {nbytes / 1e9:.3f} GB bf16; owners progressed every {args.progress_us:.0f} µs when idle; "
                  f"load average {os.getloadavg()[0]:.2f}", flush=True)  # fmt: skip

            async with role(hosts[1], base | {"role": "receiver", "registry": registry, "name": "lone",
                                              "relay": False}, env) as lone:  # fmt: skip
                await ask(lone, {"refit": version})  # warm-up: plans, connections
                seconds = []
                for _ in range(args.rounds):
                    version += 1
                    await ask(trainer, {"version": version})
                    seconds.append((await ask(lone, {"refit": version}))["seconds"])
            refit = statistics.median(seconds)
            print(f"refitflow refit (in place, verified): {gbps(nbytes, refit)}", flush=True)

            async with role(hosts[2], base | {"role": "raw", "registry": registry}, env) as raw:
                reads = (await ask(raw, {"raw": version, "rounds": args.rounds + 1}))["seconds"][1:]
            print(f"raw NIXL READ over TCP: {gbps(nbytes, statistics.median(reads))}; refitflow / raw = "
                  f"{statistics.median(reads) / refit:.2f}", flush=True)  # fmt: skip

            init = f"tcp://{t.address}:7300"
            async with role(hosts[3], base | {"role": "gloo", "init": init, "world": 2, "rank": 1}, env) as receiver:
                gloo: dict[str, Any] = {}

                async def side(child: LineChild, cmd: dict[str, Any], key: str) -> None:
                    gloo[key] = await ask(child, cmd)

                async with anyio.create_task_group() as tg:
                    tg.start_soon(side, trainer, {"gloo": {"init": init, "world": 2, "rounds": args.rounds + 1}}, "t")
                    tg.start_soon(side, receiver, {"rounds": args.rounds + 1}, "r")
            bcast = statistics.median(gloo["r"]["seconds"][1:])
            print(f"gloo broadcast over TCP: {gbps(nbytes, bcast)}; refitflow / gloo = {bcast / refit:.2f}", flush=True)

            names = ["f1", "f2", "f3", "f4"]
            specs = [base | {"role": "receiver", "registry": registry, "name": n, "relay": True} for n in names]
            fan = [role(h, s, env) for h, s in zip(hosts[1:], specs, strict=True)]
            for child in fan:
                await child.__aenter__()
            try:
                version += 1
                await ask(trainer, {"version": version})
                await fan_refit(fan, version)  # warm-up
                version += 1
                await ask(trainer, {"version": version})
                before = (await ask(trainer, {"served": True}))["served"]
                results = await fan_refit(fan, version)
                egress = (await ask(trainer, {"served": True}))["served"] - before
            finally:
                for child in fan:
                    await child.__aexit__(None, None, None)
            slowest = max(r["seconds"] for r in results)
            print(f"fan-out to 4 hosts: trainer egress {egress / nbytes:.2f} model copies; slowest receiver "
                  f"{gbps(nbytes, slowest)} = {slowest / refit:.2f}x the lone one", flush=True)  # fmt: skip


async def fan_refit(children: list[LineChild], version: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{}] * len(children)

    async def one(i: int) -> None:
        out[i] = await ask(children[i], {"refit": version})

    async with anyio.create_task_group() as tg:
        for i in range(len(children)):
            tg.start_soon(one, i)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mb", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--env", nargs="*", default=[], help="KEY=VALUE for every role (UCX settings, say)")
    p.add_argument("--progress-us", type=float, default=5000.0,
                   help="NixlTransport(progress_interval_s=) of the data owners, in µs (default 5 ms)")  # fmt: skip
    anyio.run(run, p.parse_args())


if __name__ == "__main__":
    main()
