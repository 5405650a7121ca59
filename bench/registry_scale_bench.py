"""The registry at 1,000 receivers: every one joins, fetches and relays one version of 60,000 tensors.

    python bench/registry_scale_bench.py [--receivers 1000] [--tensors 60000] [--world 8] [--workers 4]
                                         [--baseline 1680af6] [--versions 2]

The real registry service (``refitflow registry``, its own process, open) and real sockets: a trainer client
publishes each version two-phase (every rank's layout, then its digests: ``--world`` ranks, the tensors dealt
round-robin, rank r holding ``layers.{t}`` for t ≡ r mod world); ``--receivers`` receivers (RegistryClients,
tasks in ``--workers`` processes) then each, at once: wait for the version, fetch what it reads of it, join its
relays with an offer (receiver i holds what trainer rank i mod world publishes — a ``--world``-way expert
layout: one relay layout per rank position), and report it done. What it fetches: where the tree has them,
the version's outline and the part of the digests it reads — every digest of rank i mod world
(``RegistryClient.wait_outline``, ``Outline.digests``: the receiver code's calls); before, every rank's
manifest (8 fetches in flight per worker process, over one raw socket, the reply's bytes not decoded:
megabytes each). Printed per version: the registry's CPU seconds (``/proc/<pid>/stat``), the bytes on its
sockets (its peers count every frame to and from it), p50/p99 of each request as the receivers saw it, and
the size of a relay join's request and answer (p50/max bytes, as the client's frame holds them). Version 1 is
every layout's first sight; later ones are the steady state of a fleet that refits.

``--baseline COMMIT`` runs the same with an earlier refitflow's source tree (``git archive``), registry and
clients alike, in the same run (before, then this tree).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import pathlib
import statistics
import subprocess
import sys
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from _meter import MOVED, count_zmq_bytes, cpu_seconds  # noqa: E402
from _tree import source_of  # noqa: E402


def _peak_rss(pid: int) -> int:
    """The peak resident memory of process ``pid``, bytes."""
    status = pathlib.Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmHWM:")).split()[1]) * 1024


FETCHES = 8  # fetches in flight per worker process: a version's manifests (or its first sight's layouts) are MBs


def _names(tensors: int, world: int, rank: int) -> list[str]:
    return [f"model.layers.{t // 384}.mlp.experts.{t % 384}.weight" for t in range(rank, tensors, world)]


def _manifest(version: int, rank: int, world: int, tensors: int, *, pending: bool) -> Any:
    import refitflow as rf

    shards = tuple(
        rf.ShardSpec(name=n, dtype="bfloat16", global_shape=(16, 64), axis=None, start=0, stop=16, region=i,
                     digest="" if pending else f"{(version << 32) + i:016x}")
        for i, n in enumerate(_names(tensors, world, rank))
    )  # fmt: skip
    return rf.Manifest(identity=rf.Identity(model="scale"), version=version, rank=rank, world_size=world,
                       shards=shards, source=rf.SourceAddress(transport="nixl", agent=f"trainer-{rank}",
                                                              metadata=b"\x01" * 2048))  # fmt: skip


def _offer(version: int, receiver: int, world: int, tensors: int) -> Any:
    import refitflow as rf
    from refitflow.core.fanout import HeldBox, RelayOffer, RelayParam

    rank = receiver % world
    names = _names(tensors, world, rank)
    box = ((0, 16), (0, 64))
    return RelayOffer(
        identity=rf.Identity(model="scale"), version=version, receiver=f"r{receiver}",
        source=rf.SourceAddress(transport="nixl", agent=f"r{receiver}", metadata=b"\x02" * 2048), status=len(names),
        params=tuple(RelayParam(n, "bfloat16", (16, 64), i) for i, n in enumerate(names)),
        held=tuple(HeldBox(rank, n, box, i, box) for i, n in enumerate(names)),
    )  # fmt: skip


async def _receivers(address: str, ids: list[int], world: int, tensors: int, versions: int, conn: Any) -> None:
    import orjson
    import zmq
    import zmq.asyncio

    import refitflow as rf
    from refitflow.core.wire import PROTOCOL_VERSION
    from refitflow.registry.client.client import RegistryClient

    count_zmq_bytes()
    ident = rf.Identity(model="scale")
    clients = [RegistryClient(address, request_timeout_s=300) for _ in ids]
    for c in clients:
        await c.__aenter__()
    await asyncio.gather(*(c.register_receiver(ident, f"r{i}") for c, i in zip(clients, ids, strict=True)))
    offers = {i: _offer(1, i, world, tensors) for i in ids}  # built once: the bench times the registry
    fetching = asyncio.Semaphore(FETCHES)
    dealer = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    dealer.connect(address)

    async def fetch(version: int) -> None:
        request = {"v": PROTOCOL_VERSION, "id": version, "op": "manifests", "identity": {"model": "scale"},
                   "version": version}  # fmt: skip
        await dealer.send(orjson.dumps(request))
        reply = await dealer.recv()
        MOVED[0] += len(reply)
        assert b'"ok":true' in reply[:200], reply[:300]

    partial = hasattr(clients[0], "wait_outline")
    joins: dict[str, list[int]] = {"request": [], "answer": []}

    def sized(c: Any) -> None:  # a relay join's request and answer, as the client's frame holds them
        request = c._request

        async def spy(op: str, **args: Any) -> Any:
            found = await request(op, **args)
            if op == "relay_join":
                args = {k: v for k, v in args.items() if k != "max_bytes"}
                joins["request"].append(len(orjson.dumps({"v": PROTOCOL_VERSION, "id": 1, "op": op, **args})))
                joins["answer"].append(len(orjson.dumps(found)))
            return found

        c._request = spy

    for c in clients:
        sized(c)
    orders: dict[int, tuple[Any, int]] = {}

    async def read(c: Any, i: int, v: int) -> None:
        """What receiver i reads of version v: every digest of trainer rank i mod world (its part)."""
        import operator

        from refitflow.core.types import TILING_FIELDS

        outline = await c.wait_outline(ident, v, 300)
        if i not in orders:
            rank, place = i % world, operator.attrgetter("name", *TILING_FIELDS)
            shards = outline.manifests[rank].shards
            order = tuple((rank, p, place(s)) for p, s in enumerate(shards))
            orders[i] = (order, sum(s.tiling.count for s in shards))
        order, count = orders[i]
        assert len(await outline.digests(order, count)) == count

    conn.send("ready")
    for version in range(1, versions + 1):
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)  # published
        times: dict[str, list[float]] = {"latest": [], "fetch": [], "relay_join": [], "report": []}
        MOVED[0] = 0
        joins["request"].clear()
        joins["answer"].clear()

        async def one(c: Any, i: int, v: int = version, times: dict[str, list[float]] = times) -> None:
            if partial:
                async with fetching:  # as many in flight as the manifests' fetches before (a version's first
                    t = time.perf_counter()  # sight is megabytes: every rank's layout)
                    await read(c, i, v)
                    times["fetch"].append(time.perf_counter() - t)
            else:
                t = time.perf_counter()
                found = await c._request("latest", identity={"model": "scale"}, min_version=v)
                times["latest"].append(time.perf_counter() - t)
                assert found is not None and found["version"] == v, found
                async with fetching:  # the bytes, as every rank asks them (not decoded here: the registry is timed)
                    t = time.perf_counter()
                    await fetch(v)
                    times["fetch"].append(time.perf_counter() - t)
            offer = offers[i]
            offer = type(offer)(
                **{
                    **{
                        k: getattr(offer, k)
                        for k in ("identity", "receiver", "source", "status", "params", "held", "layout")
                    },
                    "version": v,
                }
            )
            t = time.perf_counter()
            await c.relay_join(ident, v, f"r{i}", layout=offer.layout, offer=offer)
            times["relay_join"].append(time.perf_counter() - t)
            t = time.perf_counter()
            await c.report(ident, f"r{i}", v)
            times["report"].append(time.perf_counter() - t)

        await asyncio.gather(*(one(c, i) for c, i in zip(clients, ids, strict=True)))
        conn.send(({k: v for k, v in times.items() if v}, MOVED[0], dict(joins)))
    for c in clients:
        await c.__aexit__(None, None, None)
    dealer.close(linger=0)


def _worker(address: str, ids: list[int], world: int, tensors: int, versions: int, conn: Any) -> None:
    asyncio.run(_receivers(address, ids, world, tensors, versions, conn))


async def run(args: argparse.Namespace) -> dict[str, Any]:
    """This interpreter's refitflow, registry and clients: the figures of each version."""
    from refitflow.registry.client.client import RegistryClient

    count_zmq_bytes()
    code = "import sys; from refitflow.cli.registry_cmd import registry_main; sys.exit(registry_main(sys.argv[1:]))"
    flags = ("--bind", "tcp://127.0.0.1:*", "--lease-s", "600", "--open")
    registry = await asyncio.create_subprocess_exec(sys.executable, "-c", code, *flags, stdout=asyncio.subprocess.PIPE)
    assert registry.stdout is not None
    address = (await registry.stdout.readline()).decode().split(" serving at ")[1].split()[0]
    ctx = mp.get_context("spawn")
    pipes, procs = [], []
    for w in range(args.workers):
        ids = list(range(w, args.receivers, args.workers))
        mine, theirs = ctx.Pipe()
        proc = ctx.Process(target=_worker, args=(address, ids, args.world, args.tensors, args.versions, theirs))
        proc.start()
        pipes.append(mine)
        procs.append(proc)
    loop = asyncio.get_running_loop()
    for p in pipes:
        assert await loop.run_in_executor(None, p.recv) == "ready"
    out: dict[str, Any] = {"versions": []}
    try:
        async with RegistryClient(address, request_timeout_s=300) as trainer:
            for version in range(1, args.versions + 1):
                pending = [_manifest(version, r, args.world, args.tensors, pending=True) for r in range(args.world)]
                done = [_manifest(version, r, args.world, args.tensors, pending=False) for r in range(args.world)]
                cpu0, MOVED[0] = cpu_seconds(registry.pid), 0
                t0 = time.perf_counter()
                for m in pending:
                    await trainer.publish(m)
                for m in done:
                    await trainer.publish(m)
                published = time.perf_counter() - t0
                cpu1, published_bytes = cpu_seconds(registry.pid), MOVED[0]
                for p in pipes:
                    p.send("go")
                times: dict[str, list[float]] = {}
                sizes: dict[str, list[int]] = {"request": [], "answer": []}
                moved = published_bytes
                for p in pipes:
                    worker_times, worker_bytes, worker_joins = await loop.run_in_executor(None, p.recv)
                    moved += worker_bytes
                    for op, values in worker_times.items():
                        times.setdefault(op, []).extend(values)
                    for k, got in worker_joins.items():
                        sizes[k].extend(got)
                took = time.perf_counter() - t0
                cpu2 = cpu_seconds(registry.pid)
                out["versions"].append({
                    "publish_s": published, "publish_cpu": cpu1 - cpu0, "publish_bytes": published_bytes,
                    "cpu": cpu2 - cpu0, "bytes": moved, "wall": took, "rss": _peak_rss(registry.pid),
                    "ops": {op: (_pct(v, 50), _pct(v, 99)) for op, v in times.items()},
                    "join": {k: (int(_pct([float(x) for x in v], 50)), max(v)) for k, v in sizes.items() if v},
                })  # fmt: skip
    finally:
        for proc in procs:
            proc.join(60)
        registry.terminate()
        await registry.wait()
    return out


def _pct(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100)[q - 1] if len(values) > 1 else values[0]


def baseline(args: argparse.Namespace) -> dict[str, Any]:
    with source_of(args.baseline) as src:
        argv = [a for a in sys.argv[1:]]
        env = {**os.environ, "PYTHONPATH": str(src)}
        run_ = subprocess.run([sys.executable, __file__, "--json", *argv], capture_output=True, text=True, env=env)
        if run_.returncode:
            raise SystemExit(f"the baseline run failed:\n{run_.stderr[-4000:]}")
        return dict(json.loads(run_.stdout.strip().splitlines()[-1]))


def show(label: str, out: dict[str, Any], args: argparse.Namespace) -> None:
    print(f"{label}:")
    for v, row in enumerate(out["versions"], 1):
        ops = "  ".join(f"{op} {p50 * 1e3:.1f}/{p99 * 1e3:.1f}" for op, (p50, p99) in row["ops"].items())
        join = row.get("join", {})
        sized = "; relay join bytes p50/max: " + ", ".join(f"{k} {a}/{b}" for k, (a, b) in join.items()) if join else ""
        print(f"  version {v}: registry CPU {row['cpu']:.2f} s (publish {row['publish_cpu']:.2f} s), "
              f"{row['bytes'] / 1e9:.2f} GB moved, peak RSS {row.get('rss', 0) / 1e9:.1f} GB, "
              f"all done in {row['wall']:.1f} s; "
              f"p50/p99 ms: {ops}{sized}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--receivers", type=int, default=1000)
    ap.add_argument("--tensors", type=int, default=60_000)
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--versions", type=int, default=2)
    ap.add_argument("--baseline", default="", help="an earlier refitflow (a git commit) to run first")
    ap.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.json:
        print(json.dumps(asyncio.run(run(args))))
        return
    print(f"{args.receivers} receivers, one version of {args.tensors} tensors from {args.world} trainer ranks, "
          f"{args.versions} versions; load {os.getloadavg()[0]:.2f}")  # fmt: skip
    if args.baseline:
        show(args.baseline, baseline(args), args)
    show("this tree", asyncio.run(run(args)), args)


if __name__ == "__main__":
    main()
