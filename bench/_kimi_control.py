"""A version's control traffic at Kimi-K2 shapes, with the real registry service and the real receiver code.

``python bench/kimi_plan_bench.py --control [--baseline COMMIT]`` (``kimi_plan_bench`` parses the flags and
builds the publication; this module runs it):

- the registry: ``refitflow registry`` in a process of its own (open, in memory);
- the trainer: one ``RegistryClient`` publishes every rank's manifest of each version (random digests, so every
  version's differ), one rank after the other, as a trainer's ranks would at once;
- each receiver rank asked for (``--ranks``; vLLM EP ``tpN``): a ``RegistryClient`` of its own and the real
  receiver code — ``wait_outline`` and ``stages._checks.version_digests`` where the tree has them (the plan's
  part of the digests), else ``wait_complete`` and ``Plan.digests`` (every rank's whole manifest) — its plan
  built once, as a receiver's first refit does; after the first version every bucket's checks are made, as
  they are once a receiver's first refit is over.

Printed per version: the registry's work to accept the version — the very requests the trainer sent, replayed
through the service's frame decoding and request handler (``frames.decode_request``, ``ops.Handler``: every
check, the store's record) in this process, CPU seconds (what ``bench/_sim_costs.py`` measures) — and the registry
process's CPU while it took them over its socket (``/proc``: ZMQ and the kernel's TCP work besides), the bytes the
trainer sent;
per receiver rank, the bytes it received (every frame on its sockets) and its fetch + decode seconds; and the
registry's egress for ``--engines`` engines of such receivers (every rank of an engine fetches what the ranks
measured fetch on average, times the ranks of all engines). ``--baseline``: the same with an earlier tree,
first, in the same run (its source from ``git archive``).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np
import xxhash
from _meter import MOVED, count_zmq_bytes, cpu_seconds

import refitflow as rf


def _version(pub: rf.Publication, version: int) -> list[rf.Manifest]:
    """Every rank's manifest of ``version``: ``pub``'s layouts, random digests (xxh3 of the blocks, as published)."""
    rng = np.random.default_rng(version)
    out = []
    for m in pub.manifests:
        shards = []
        for s in m.shards:
            raw = rng.integers(0, 1 << 63, len(s.digest_bytes) // 8, dtype=np.uint64).astype(">u8").tobytes()
            tiled = bool(s.tile_rows)
            shards.append(rf.ShardSpec(
                name=s.name, dtype=s.dtype, global_shape=s.global_shape, axis=s.axis, start=s.start, stop=s.stop,
                digest=xxhash.xxh3_64_hexdigest(raw) if tiled else raw.hex(), region=s.region, offset=s.offset,
                algo=s.algo, tile_rows=s.tile_rows, tile_cols=s.tile_cols,
                blocks=base64.b64encode(raw).decode() if tiled else "",
            ))  # fmt: skip
        out.append(rf.Manifest(identity=m.identity, version=version, rank=m.rank, world_size=m.world_size,
                               source=m.source, shards=tuple(shards), metadata=m.metadata))  # fmt: skip
    return out


async def _run(a: argparse.Namespace) -> dict[str, Any]:
    import torch
    from kimi_plan_bench import ApplyMode, Destination, ReceiverConfig, build_plan, kimi_k2, publication

    from refitflow.core.wire import PROTOCOL_VERSION, encode
    from refitflow.layouts import fused
    from refitflow.registry.client.client import RegistryClient
    from refitflow.registry.limits import RegistryLimits
    from refitflow.registry.service.frames import decode_request
    from refitflow.registry.service.ops import Handler
    from refitflow.registry.service.store import RegistryStore

    try:
        from refitflow.refit.digests import version_digests
    except ImportError:  # a tree before layouts and parts: every receiver decodes every rank's manifest
        version_digests = None

    count_zmq_bytes()
    d = kimi_k2(a.layers, a.experts)
    shape, _ = publication(d, a.train_tp, a.train_ep, a.train_pp, a.apart)
    ident = shape.identity
    code = "import sys; from refitflow.cli.registry_cmd import registry_main; sys.exit(registry_main(sys.argv[1:]))"
    registry = await asyncio.create_subprocess_exec(
        sys.executable, "-c", code, "--bind", "tcp://127.0.0.1:*", "--lease-s", "600", "--open",
        stdout=asyncio.subprocess.PIPE)  # fmt: skip
    assert registry.stdout is not None
    address = (await registry.stdout.readline()).decode().split(" serving at ")[1].split()[0]
    out: dict[str, Any] = {"versions": [], "shards": sum(len(m.shards) for m in shape.manifests),
                           "ranks": len(shape.manifests), "partial": version_digests is not None}  # fmt: skip
    limits = ReceiverConfig().limits
    receivers = []
    try:
        for r in a.rank_list:
            par = fused.parallel(tp=a.rtp, tp_rank=r % a.rtp, dp=a.rdp, dp_rank=r // a.rtp, expert_parallel=True)
            layout = fused.layout(d, par)
            params = {n: torch.empty(lt.shape, dtype=torch.bfloat16, device="meta") for n, lt in layout.items()}
            client = RegistryClient(address, request_timeout_s=600)
            receivers.append((r, client, Destination(params, ApplyMode.IN_PLACE, layout), {}))
        async def announced(identity: Any, version: int) -> None:
            pass

        limits_ = RegistryLimits()
        replay = Handler(RegistryStore(lease_s=600), hello={}, limits=limits_, announce=announced)
        async with RegistryClient(address, request_timeout_s=600) as trainer:
            sent: list[tuple[str, dict[str, Any]]] = []
            request = trainer._request

            async def spy(op: str, **args: Any) -> Any:
                if op in ("publish", "complete"):
                    sent.append((op, {k: v for k, v in args.items() if k != "max_bytes"}))
                return await request(op, **args)

            trainer._request = spy  # type: ignore[method-assign]
            for version in range(1, a.versions + 1):
                manifests = await asyncio.to_thread(_version, shape, version)
                cpu0, MOVED[0] = cpu_seconds(registry.pid), 0
                t0 = time.perf_counter()
                sent.clear()
                for m in manifests:
                    await trainer.publish(m)
                row: dict[str, Any] = {"publish_s": time.perf_counter() - t0,
                                       "publish_cpu": cpu_seconds(registry.pid) - cpu0,
                                       "publish_bytes": MOVED[0], "receivers": []}  # fmt: skip
                del manifests
                frames = [encode({"v": PROTOCOL_VERSION, "id": i, "op": op, **kw}) for i, (op, kw) in enumerate(sent)]
                sent.clear()
                work0 = time.process_time()
                for frame in frames:
                    await replay.handle(await decode_request(frame, limits_.max_shards))
                row["work"] = time.process_time() - work0
                del frames
                for r, client, dest, state in receivers:
                    cpu0, MOVED[0] = cpu_seconds(registry.pid), 0
                    t0 = time.perf_counter()
                    wait = client.wait_outline if version_digests is not None else client.wait_complete
                    pub = await wait(ident, version, 600)
                    fetched = time.perf_counter() - t0
                    if "plan" not in state:  # the first refit's plan (not a per-version cost)
                        state["plan"] = await asyncio.to_thread(build_plan, pub, dest, limits)
                    plan = state["plan"]
                    t1 = time.perf_counter()
                    if version_digests is not None:
                        vector = await version_digests(plan, pub)
                    else:
                        vector = await asyncio.to_thread(plan.digests, pub)
                    took = fetched + time.perf_counter() - t1
                    assert len(vector) == plan.digest_count
                    row["receivers"].append({"rank": r, "bytes": MOVED[0], "s": took,
                                             "cpu": cpu_seconds(registry.pid) - cpu0})  # fmt: skip
                    if "built" not in state:  # the first refit over: every bucket's checks are made
                        await asyncio.to_thread(lambda p=plan: [b.built() for b in p.buckets])
                        state["built"] = True
                    del pub, vector
                out["versions"].append(row)
    finally:
        for _, client, _, _ in receivers:
            await client.aclose()
        registry.terminate()
        await registry.wait()
    return out


def show(label: str, out: dict[str, Any], a: argparse.Namespace) -> None:
    ranks = a.rtp * a.rdp
    what = "a plan part of the digests" if out["partial"] else "every rank manifest whole"
    print(f"{label}: {out['ranks']} trainer ranks, {out['shards']:,} shard specs; {what} per receiver")
    for v, row in enumerate(out["versions"], 1):
        got = row["receivers"]
        mean = statistics.mean(x["bytes"] for x in got)
        each = ", ".join(f"rank {x['rank']} {x['bytes'] / 1e6:.2f} MB {x['s'] * 1e3:.0f} ms" for x in got)
        serve = statistics.mean(x["cpu"] for x in got)
        print(f"  version {v}: registry work {row['work']:.2f} s ({row['publish_cpu']:.2f} s of its process's CPU, "
              f"{row['publish_bytes'] / 1e6:.0f} MB from the trainer); per receiver fetch + decode: {each}; registry "
              f"CPU per receiver served {serve * 1e3:.0f} ms; egress for {a.engines} engines x {ranks} ranks "
              f"{a.engines * ranks * mean / 1e9:.2f} GB")  # fmt: skip


def run(a: argparse.Namespace) -> None:
    """Run in this interpreter (its refitflow), or print a baseline tree's figures first (``--baseline``)."""
    if a.json:
        print(json.dumps(asyncio.run(_run(a))))
        return
    print(f"control plane per version at Kimi-K2 shapes; load {os.getloadavg()[0]:.2f} (2 cores, shared)")
    if a.baseline:
        sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
        from _tree import source_of

        with source_of(a.baseline) as src:
            bench = pathlib.Path(__file__).resolve().parent / "kimi_plan_bench.py"
            given = sys.argv[1:]
            argv = [x for i, x in enumerate(given) if not x.startswith("--baseline")
                    and not (i and given[i - 1] == "--baseline")]  # fmt: skip
            env = {**os.environ, "PYTHONPATH": f"{src}{os.pathsep}{bench.parent}"}
            done = subprocess.run([sys.executable, str(bench), *argv, "--json"], capture_output=True, text=True,
                                  env=env)  # fmt: skip
            if done.returncode:
                raise SystemExit(f"the baseline run failed:\n{done.stderr[-4000:]}")
            show(a.baseline, json.loads(done.stdout.strip().splitlines()[-1]), a)
    show("this tree", asyncio.run(_run(a)), a)
