"""``python -m bench``: refitflow against the limit and against what users pick today, same bytes, one run.

    python -m bench [--size-mb 512] [--versions 3] [--budget-mb 256] [--json bench/results/bench.json]

Needs the ``nixl`` and ``bench`` extras (``pip install -e '.[nixl,bench]'``; without safetensors the
/dev/shm row is skipped, saying so).

Rows: one-thread memcpy (the limit); raw NIXL READ of every shard (no pipeline); refitflow over NIXL,
in place and shadow (trainer process publishing two ranks, receiver process, registry service); torch
gloo broadcast of packed buckets from rank 0; save to /dev/shm safetensors then load. Every row is
measured in its own processes on the same synthetic bf16 model; GB/s = 10^9 bytes per second, best of
the warm versions; peak RSS is the receiving process's.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import platform
from typing import Any

os.environ.setdefault("UCX_NET_DEVICES", "lo")  # a benchmark entry point, like the CLI, may set the environment
os.environ.setdefault("UCX_LOG_LEVEL", "error")

import anyio
import torch

from bench._raw_reader import raw_reader_role
from bench.baselines import gloo_broadcast, memcpy_gbps, shm_safetensors
from refitflow.cli.demo import run_processes
from refitflow.cli.demo_roles import RoleConfig, publisher_role, receiver_role
from refitflow.cli.synthetic import synthetic_nbytes, synthetic_shapes
from refitflow.registry.embedded import Registry


async def refitflow_row(cfg: RoleConfig, role: Any, mode: str) -> dict[str, Any]:
    """Run the trainer process and one receiving process; return that receiver's figures."""
    events: list[dict[str, Any]] = []
    async with Registry.serve("tcp://127.0.0.1:*", lease_s=60) as server:
        roles = [
            (publisher_role, (server.address, cfg, 1), "publisher"),
            (role, (mode, mode, server.address, cfg), mode),
        ]
        await run_processes(roles, cfg.timeout_s, events.append)
    errors = [e["error"] for e in events if e["kind"] == "error"]
    if errors:
        raise RuntimeError(f"{mode}: {errors}")
    raw = [e for e in events if e["kind"] == "raw"]
    if raw:
        return {"gbps": raw[0]["gbps"], "first_gbps": raw[0]["first_gbps"], "rss": None, "peak_staging": 0}
    refits = [e for e in events if e["kind"] == "refit"]
    assert all(e["committed"] for e in refits) and len(refits) == cfg.versions, refits
    warm = refits[1:] or refits
    return {
        "gbps": max(e["gbps"] for e in warm),
        "first_gbps": refits[0]["gbps"],
        "rss": max(e["rss"] for e in refits),
        "peak_staging": max(e["peak_staging"] for e in refits),
        "stages_ms": {k: v * 1e3 for k, v in warm[-1]["stages"].items()},
        "finish_ms": min(e["finish_seconds"] for e in warm) * 1e3,  # the commit, after prepare
    }


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench")
    ap.add_argument("--size-mb", type=float, default=512.0, help="model size, MB (10^6 bytes)")
    ap.add_argument("--versions", type=int, default=3)
    ap.add_argument("--budget-mb", type=float, default=256.0, help="staging budget, MiB")
    ap.add_argument("--json", default="bench/results/bench.json")
    args = ap.parse_args()
    size = int(args.size_mb * 1e6)
    nbytes = synthetic_nbytes(size)
    cfg = RoleConfig(size_bytes=size, versions=args.versions, budget_bytes=int(args.budget_mb * 2**20),
                     transport="nixl", timeout_s=600)  # fmt: skip
    rows = anyio.run(collect, cfg, nbytes)
    report(rows, cfg, nbytes, pathlib.Path(args.json))


async def collect(cfg: RoleConfig, nbytes: int) -> dict[str, dict[str, Any]]:
    size, versions = cfg.size_bytes, cfg.versions
    rows: dict[str, dict[str, Any]] = {}
    rows["one-thread memcpy (limit)"] = {"gbps": memcpy_gbps(nbytes), "rss": None, "peak_staging": 0}
    rows["raw NIXL READ (no pipeline)"] = await refitflow_row(cfg, raw_reader_role, "raw")
    rows["refitflow NIXL in_place"] = await refitflow_row(cfg, receiver_role, "in_place")
    rows["refitflow NIXL shadow"] = await refitflow_row(cfg, receiver_role, "shadow")
    gloo = await anyio.to_thread.run_sync(gloo_broadcast, size, versions)
    rows["gloo broadcast, packed buckets"] = {"gbps": nbytes / gloo["seconds"] / 1e9, "rss": gloo["rss"],
                                              "peak_staging": 64 << 20}  # fmt: skip
    if importlib.util.find_spec("safetensors") is None:
        print("skipped the /dev/shm safetensors row: it needs safetensors (pip install -e '.[bench]')")
        return rows
    shm = await anyio.to_thread.run_sync(shm_safetensors, size, versions)
    rows["/dev/shm safetensors save+load"] = {"gbps": nbytes / shm["seconds"] / 1e9, "rss": shm["rss"],
                                              "peak_staging": nbytes}  # fmt: skip
    return rows


def report(rows: dict[str, dict[str, Any]], cfg: RoleConfig, nbytes: int, out: pathlib.Path) -> None:
    limit = rows["one-thread memcpy (limit)"]["gbps"]
    tensors = len(synthetic_shapes(cfg.size_bytes))
    print(f"model {nbytes / 1e9:.3f} GB bf16 ({tensors} tensors), {cfg.versions} versions, "
          f"{os.cpu_count()} CPUs, torch {torch.__version__}, {platform.platform()}")  # fmt: skip
    print(f"{'path':<34} {'GB/s':>7} {'x memcpy':>9} {'peak RSS MB':>12} {'peak staging MB':>16}")
    for name, r in rows.items():
        rss = "-" if r.get("rss") is None else f"{r['rss'] / 1e6:.0f}"
        print(f"{name:<34} {r['gbps']:7.2f} {r['gbps'] / limit:9.2f} {rss:>12} {r['peak_staging'] / 1e6:16.1f}")
    for name in ("refitflow NIXL in_place", "refitflow NIXL shadow"):
        stages = ", ".join(f"{k} {v:.1f}" for k, v in rows[name]["stages_ms"].items())
        print(f"{name}, last refit, per-stage busy ms: {stages}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"nbytes": nbytes, "versions": cfg.versions, "rows": rows,
                               "platform": platform.platform(), "cpus": os.cpu_count()}, indent=2))  # fmt: skip
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
