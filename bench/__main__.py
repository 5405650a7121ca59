"""``python -m bench``: refitflow against the limit and against what a competent user does today, same bytes.

    python -m bench [--quick] [--size-mb 512] [--versions 5] [--budget-mb 256] [--json bench/results/bench.json]

Needs the ``nixl`` and ``bench`` extras (``pip install -e '.[nixl,bench]'``; without safetensors the
/dev/shm row is skipped, saying so). ``--quick``: a CI-sized smoke run (40 MB, 2 versions) whose
figures mean nothing.

Every row but memcpy runs in its own processes on the same synthetic bf16 model, one torch thread
each, and ends with the receiver's weights checked bit-exact against the trainer's (a digest of every
tensor's bytes); the command exits 1 if one is not. Rows:

- memcpy: ``dst.copy_(src)`` of the model's bytes in this process, one thread and torch's default count.
- raw NIXL READ: every shard of the trainer's two ranks read straight into the receiving process's
  parameters, no pipeline: the limit of refitflow's receiving side.
- refitflow over NIXL, in place and shadow: a trainer process publishing as two ranks (one after the
  other), a receiving process, the registry service in this process; and in place with the trainer
  announcing each version before its digests (``Publisher(announce_early=True)``, its two ranks at once):
  the receiver reads while the trainer hashes, and compares once the digests arrive.
- gloo broadcast into the parameters; gloo packed buckets with reused buffers; /dev/shm safetensors
  (``bench/baselines.py``).

Columns (GB/s = model bytes / seconds, 10^9 bytes per second, best of the warm versions, all but the first):

- publish→commit: from the trainer's go (refitflow: before ``publish()``, so its digests count; the
  baselines: before the first send or the save) to the receiver holding every new byte (refitflow:
  ``finish()`` returned). The two marks are ``time.monotonic()`` in two processes: ``CLOCK_MONOTONIC``,
  one clock for every process of a Linux host.
- receiver only: refitflow from finding the publication to commit; raw NIXL the reads alone.
- peak RSS of the trainer's and the receiver's process, each measured in itself (``VmHWM``).
- staging: refitflow's peak staging bytes; the packed baseline's bucket; the safetensors file.

After the table, each refitflow row's last version as a timeline from the trainer's go: when the receiver
found it, each read (start–end, bytes, GB/s), when the trainer's ``publish()`` returned, the commit.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import pathlib
import platform
import sys
import time
from typing import Any

os.environ.setdefault("UCX_NET_DEVICES", "lo")  # a benchmark entry point, like the CLI, may set the environment
os.environ.setdefault("UCX_LOG_LEVEL", "error")

import anyio
import torch

from bench._raw_reader import raw_reader_role
from bench.baselines import GLOO, SHM, best_gbps, gloo_rows, memcpy_gbps, shm_row
from refitflow.cli.demo import run_processes
from refitflow.cli.demo_roles import RoleConfig, publisher_role, receiver_role
from refitflow.cli.synthetic import synthetic_nbytes, synthetic_shapes
from refitflow.registry.service.embedded import Registry

RAW = "raw NIXL READ into the parameters (no pipeline)"
# row name -> (receiver mode, the trainer announces each version before its digests: two-phase publication)
REFIT = {
    "refitflow over NIXL, in place": ("in_place", False),
    "refitflow over NIXL, shadow": ("shadow", False),
    "refitflow over NIXL, in place, announced early": ("in_place", True),
}
QUICK = {"size_mb": 40.0, "versions": 2}
FULL = {"size_mb": 512.0, "versions": 5}


async def refitflow_row(cfg: RoleConfig, role: Any, mode: str) -> dict[str, Any]:
    """Run the trainer process and one receiving process (``role``); return that row's figures.

    ``gbps``/``first_gbps`` are the pipeline's own figure (``RefitResult.gbps``: discovery to
    prepared, pulled bytes), which ``gpu_check`` and ``stream_bench`` compare with raw NIXL.
    """
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
    nbytes = synthetic_nbytes(cfg.size_bytes)
    trainer = next(e for e in events if e["kind"] == "trainer_done")
    raw = [e for e in events if e["kind"] == "raw"]
    if raw:
        best, first = best_gbps(nbytes, raw[0]["seconds"])
        return {"e2e_gbps": None, "receiver_gbps": best, "first_receiver_gbps": first,
                "receiver_seconds": raw[0]["seconds"], "gbps": best, "first_gbps": first,
                "trainer_rss": trainer["rss"], "receiver_rss": raw[0]["rss"], "peak_staging": 0,
                "exact": raw[0]["digest"] == trainer["digest"]}  # fmt: skip
    refits = sorted((e for e in events if e["kind"] == "refit"), key=lambda e: e["version"])
    assert all(e["committed"] for e in refits) and len(refits) == cfg.versions, refits
    published = sorted((e for e in events if e["kind"] == "published"), key=lambda e: e["version"])
    e2e = [r["t_commit"] - p["t_go"] for r, p in zip(refits, published, strict=True)]
    receiver = [e["seconds"] + e["finish_seconds"] for e in refits]
    warm = refits[1:] or refits
    (e2e_gbps, first_e2e), (recv_gbps, first_recv) = best_gbps(nbytes, e2e), best_gbps(nbytes, receiver)
    return {
        "e2e_gbps": e2e_gbps, "first_e2e_gbps": first_e2e, "e2e_seconds": e2e,
        "receiver_gbps": recv_gbps, "first_receiver_gbps": first_recv, "receiver_seconds": receiver,
        "publish_seconds": [e["seconds"] for e in published],
        "gbps": max(e["gbps"] for e in warm), "first_gbps": refits[0]["gbps"],
        "trainer_rss": trainer["rss"], "receiver_rss": max(e["rss"] for e in refits),
        "peak_staging": max(e["peak_staging"] for e in refits),
        "stages_ms": {k: v * 1e3 for k, v in warm[-1]["stages"].items()},
        "finish_ms": min(e["finish_seconds"] for e in warm) * 1e3,  # the commit, after prepare
        "timeline": timeline(published[-1], refits[-1]),
        "exact": refits[-1]["digest"] == trainer["digest"],
    }  # fmt: skip


def timeline(published: dict[str, Any], refit: dict[str, Any]) -> dict[str, Any]:
    """One version in ms from the trainer's go (one ``CLOCK_MONOTONIC`` in every process): when the
    trainer's ``publish()`` returned, the receiver found the publication (its plan stage began), each
    transport read began and ended (and its bytes), and the commit."""
    go = published["t_go"]

    def ms(t: float) -> float:
        return round((t - go) * 1e3, 2)

    return {
        "published_ms": ms(go + published["seconds"]), "found_ms": ms(refit["entered"]["plan"]),
        "reads": [(ms(end - seconds), ms(end), nbytes) for end, nbytes, seconds in refit["reads"]],
        "committed_ms": ms(refit["t_commit"]),
    }  # fmt: skip


def _memcpy_row(nbytes: int, threads: int) -> dict[str, Any]:
    return {"e2e_gbps": None, "receiver_gbps": memcpy_gbps(nbytes, threads), "threads": threads,
            "trainer_rss": None, "receiver_rss": None, "peak_staging": 0, "exact": None}  # fmt: skip


async def collect(cfg: RoleConfig, nbytes: int, threads: int) -> dict[str, dict[str, Any]]:
    size, versions, timeout = cfg.size_bytes, cfg.versions, cfg.timeout_s
    rows: dict[str, dict[str, Any]] = {"memcpy, 1 thread (limit)": _memcpy_row(nbytes, 1)}
    rows[f"memcpy, torch's default {threads} threads"] = _memcpy_row(nbytes, threads)
    rows[RAW] = await refitflow_row(cfg, raw_reader_role, "raw")
    for name, (mode, early) in REFIT.items():
        rows[name] = await refitflow_row(dataclasses.replace(cfg, announce_early=early), receiver_role, mode)
    rows |= await gloo_rows(size, nbytes, versions, timeout)
    if importlib.util.find_spec("safetensors") is None:
        print("skipped the /dev/shm safetensors row: it needs safetensors (pip install -e '.[bench]')")
        return rows
    rows[SHM] = await shm_row(size, nbytes, versions, timeout)
    return rows


def machine(threads: int) -> dict[str, Any]:
    """What the figures were measured on."""
    cpuinfo, meminfo = (pathlib.Path(f"/proc/{f}").read_text().splitlines() for f in ("cpuinfo", "meminfo"))
    cpu = next((ln.split(":", 1)[1].strip() for ln in cpuinfo if ln.startswith("model name")), "?")
    mem = next(ln.split()[1] for ln in meminfo if ln.startswith("MemTotal"))
    return {"cpu": cpu, "cpus": os.cpu_count(), "usable_cpus": len(os.sched_getaffinity(0)),
            "memory_gib": int(mem) * 1024 / 2**30, "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__, "torch_threads": threads,
            "nixl": importlib.metadata.version("nixl")}  # fmt: skip


def ratios(rows: dict[str, dict[str, Any]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, (mode, early) in REFIT.items():
        mode += ", announced early" if early else ""
        out[f"{mode} receiver-only / raw NIXL READ"] = rows[name]["receiver_gbps"] / rows[RAW]["receiver_gbps"]
        for base in (*GLOO.values(), SHM):
            if base in rows:
                out[f"{mode} publish→commit / {base}"] = rows[name]["e2e_gbps"] / rows[base]["e2e_gbps"]
    return out


def _cell(value: float | None, scale: float = 1.0, digits: int = 2) -> str:
    return "–" if value is None else f"{value / scale:.{digits}f}"


def report(result: dict[str, Any], out: pathlib.Path) -> None:
    m, rows = result["machine"], result["rows"]
    print(f"machine: {m['cpu']}, {m['cpus']} CPUs ({m['usable_cpus']} usable), {m['memory_gib']:.1f} GiB, "
          f"{m['platform']}, Python {m['python']}, torch {m['torch']}, nixl {m['nixl']}")  # fmt: skip
    print("load average (1, 5, 15 min): before " + " ".join(f"{x:.2f}" for x in result["load_before"])
          + ", after " + " ".join(f"{x:.2f}" for x in result["load_after"]))  # fmt: skip
    print(f"model {result['nbytes'] / 1e9:.3f} GB bf16 ({result['tensors']} tensors), {result['versions']} versions "
          f"(figures: best of the warm ones), one torch thread per process")  # fmt: skip
    print(f"{'path':<50} {'publish→commit':>14} {'receiver only':>13} {'trainer RSS':>11} {'receiver RSS':>12} "
          f"{'staging':>8} {'exact':>5}")  # fmt: skip
    print(f"{'':<50} {'GB/s':>14} {'GB/s':>13} {'MB':>11} {'MB':>12} {'MB':>8}")
    for name, r in rows.items():
        exact = "–" if r["exact"] is None else "yes" if r["exact"] else "NO"
        print(f"{name:<50} {_cell(r['e2e_gbps']):>14} {_cell(r['receiver_gbps']):>13} "
              f"{_cell(r['trainer_rss'], 1e6, 0):>11} {_cell(r['receiver_rss'], 1e6, 0):>12} "
              f"{_cell(r['peak_staging'], 1e6, 1):>8} {exact:>5}")  # fmt: skip
    for name, x in result["ratios"].items():
        print(f"{name}: {x:.2f}x")
    for name in REFIT:
        publish = min(rows[name]["publish_seconds"][1:] or rows[name]["publish_seconds"])
        stages = ", ".join(f"{k} {v:.1f}" for k, v in rows[name]["stages_ms"].items())
        print(f"{name}: trainer publish() of both ranks (digests + announce) {publish * 1e3:.0f} ms; "
              f"last refit, per-stage busy ms: {stages}")  # fmt: skip
        t = rows[name]["timeline"]
        reads = ", ".join(f"{a:.0f}–{b:.0f} ({n / 2**20:.0f} MiB, {n / max(b - a, 1e-3) / 1e6:.1f} GB/s)"
                          for a, b, n in t["reads"])  # fmt: skip
        print(f"  its last version, ms from the go: found {t['found_ms']:.1f}; reads {reads}; trainer's "
              f"publish() returned {t['published_ms']:.1f}; committed {t['committed_ms']:.1f}")  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench")
    ap.add_argument("--quick", action="store_true", help="a CI-sized smoke run: 40 MB, 2 versions")
    ap.add_argument("--size-mb", type=float, help="model size, MB (10^6 bytes); default 512 (--quick: 40)")
    ap.add_argument("--versions", type=int, help="versions per row; default 5 (--quick: 2)")
    ap.add_argument("--budget-mb", type=float, default=256.0, help="staging budget, MiB")
    ap.add_argument("--json", default="bench/results/bench.json")
    args = ap.parse_args()
    preset = QUICK if args.quick else FULL
    size = int((args.size_mb or preset["size_mb"]) * 1e6)
    threads = torch.get_num_threads()  # torch's default, before anything here sets it
    cfg = RoleConfig(size_bytes=size, versions=args.versions or int(preset["versions"]),
                     budget_bytes=int(args.budget_mb * 2**20), transport="nixl", timeout_s=600)  # fmt: skip
    nbytes = synthetic_nbytes(size)
    load_before = os.getloadavg()
    t0 = time.monotonic()
    rows = anyio.run(collect, cfg, nbytes, threads)
    result = {
        "command": " ".join(["python -m bench", *sys.argv[1:]]), "nbytes": nbytes,
        "tensors": len(synthetic_shapes(size)), "versions": cfg.versions, "machine": machine(threads),
        "load_before": load_before, "load_after": os.getloadavg(), "seconds": time.monotonic() - t0,
        "rows": rows, "ratios": ratios(rows),
    }  # fmt: skip
    report(result, pathlib.Path(args.json))
    inexact = [name for name, r in rows.items() if r["exact"] is False]
    if inexact:
        sys.exit(f"not bit-exact: {inexact}")


if __name__ == "__main__":
    main()
