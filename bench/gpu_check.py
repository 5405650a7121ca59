"""One prepared check for a lent GPU machine (about 15 minutes in all): ``python bench/gpu_check.py``.

1. **tests**: ``pytest --device cuda tests/device`` in a child process — the device-path tests on CUDA
   and the CUDA-only ones (refit streams, VRAM over NIXL, CUDA graphs);
2. **in this process, on the device**: torch device-to-device copy, host-to-device copy (pinned), and
   the publisher's digest pass (``Publisher.publish`` over the loopback transport: registration is
   free there, so the time is the digests of every shard);
3. **between two processes** (a trainer process publishing two ranks, one receiver process, a registry
   service, NIXL): a raw NIXL READ of every shard into VRAM (no pipeline), then refitflow in place,
   shadow (swap) and shadow (copy), strict verify, VRAM→VRAM, and in place VRAM→DRAM.

Prints one table (GB/s = 10^9 bytes/s; best warm version, first version apart) with the issue's
targets, and writes JSON to ``$OUT/gpu_check.json`` when ``OUT`` is set (or ``--json PATH``).
Smoke mode, runnable anywhere: ``python bench/gpu_check.py --device cpu --size-gb 0.05`` runs every
step on CPU tensors (the "device" is then host memory; tests/device/test_gpu_check.py runs it).
Exit status: 0 all steps passed, 1 a step failed, 2 ``--device cuda`` without a visible GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import subprocess
import sys
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make ``bench`` importable (children inherit sys.path)
    sys.path.insert(0, str(ROOT))

import anyio  # noqa: E402
import torch  # noqa: E402

from bench.__main__ import refitflow_row  # noqa: E402 (also sets UCX_NET_DEVICES=lo, UCX_LOG_LEVEL=error)
from bench._raw_reader import raw_reader_role  # noqa: E402
from refitflow.api.publisher import Publisher  # noqa: E402
from refitflow.cli.demo_roles import IDENTITY, RoleConfig, receiver_role  # noqa: E402
from refitflow.cli.synthetic import synthetic_model, synthetic_nbytes  # noqa: E402
from refitflow.registry.service.embedded import Registry  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_gbps(src: torch.Tensor, dst: torch.Tensor, reps: int = 5) -> float:
    """Best-of-``reps`` GB/s of ``dst.copy_(src)``, synchronised on both devices."""
    times = []
    for _ in range(reps):
        _sync(dst.device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(dst.device)  # a host-to-device copy from pinned memory runs on the destination's stream
        times.append(time.perf_counter() - t0)
    return src.nbytes / min(times) / 1e9


def local_rows(device: torch.device, nbytes: int, size_bytes: int, versions: int) -> dict[str, dict[str, Any]]:
    """Copies on the device and from the host, and the publisher's digest pass, in this process."""
    rows: dict[str, dict[str, Any]] = {}
    a = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(7)
    b = torch.empty_like(a)
    rows["torch device-to-device copy"] = {"gbps": copy_gbps(a, b)}
    host = torch.empty(nbytes, dtype=torch.uint8).fill_(3)
    if device.type == "cuda":
        host = host.pin_memory()
    rows["host-to-device copy (pinned)"] = {"gbps": copy_gbps(host, b)}
    del a, b, host
    model = synthetic_model(size_bytes, device=str(device))

    async def publish_all() -> list[float]:
        times = []
        async with Publisher(Registry(), identity=IDENTITY, transport="loopback") as pub:
            for v in range(1, versions + 1):
                _sync(device)
                t0 = time.perf_counter()
                await pub.publish(v, model)
                times.append(time.perf_counter() - t0)
        return times

    times = anyio.run(publish_all)
    rows["publish: digests of every shard"] = {"gbps": nbytes / min(times[1:] or times) / 1e9,
                                               "first_gbps": nbytes / times[0] / 1e9}  # fmt: skip
    return rows


def process_rows(cfg: RoleConfig, deadline: float) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """Two processes each: the raw NIXL READ, then refitflow in every mode (a failed row is reported, not fatal)."""
    dev, host = cfg.device, "cpu"
    runs: list[tuple[str, RoleConfig, Any, str]] = [
        (f"raw NIXL READ {dev}->{dev}", cfg, raw_reader_role, "raw"),
        (f"refitflow in_place {dev}->{dev}", cfg, receiver_role, "in_place"),
        (f"refitflow shadow swap {dev}->{dev}", cfg, receiver_role, "shadow"),
        (f"refitflow shadow copy {dev}->{dev}", _with(cfg, shadow_commit="copy"), receiver_role, "shadow"),
    ]
    if dev != host:  # a receiver in host memory reading the trainer's VRAM
        runs.append((f"refitflow in_place {dev}->{host}", _with(cfg, receiver_device=host), receiver_role, "in_place"))
    rows: dict[str, dict[str, Any]] = {}
    errors: list[str] = []
    for name, row_cfg, role, mode in runs:
        t0 = time.perf_counter()
        if deadline - t0 < cfg.timeout_s:
            errors.append(f"{name}: skipped, fewer than {cfg.timeout_s:.0f} s left of --budget-s")
            continue
        try:
            rows[name] = anyio.run(refitflow_row, row_cfg, role, mode)
        except Exception as exc:
            errors.append(f"{name}: {type(exc).__name__}: {exc}")
            print(f"  FAILED {name}: {type(exc).__name__}: {exc}", flush=True)
            continue
        print(f"  {name}: {rows[name]['gbps']:.2f} GB/s ({time.perf_counter() - t0:.0f} s)", flush=True)
    return rows, errors


def _with(cfg: RoleConfig, **changes: Any) -> RoleConfig:
    return RoleConfig(**(cfg.__dict__ | changes))


def run_tests(device: str, targets: list[str], timeout_s: float) -> dict[str, Any]:
    """``pytest --device <device> <targets>`` in a child process; its last lines and exit status."""
    pytest = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    cmd = [*pytest, "--device", device, "--ignore=tests/device/test_gpu_check.py", *targets]  # not its own smoke test
    t0 = time.perf_counter()
    try:
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
        out, rc = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as exc:
        out, rc = f"{exc.stdout or ''}\npytest did not finish within {timeout_s} s", 124
    tail = [line for line in out.strip().splitlines() if line.strip()][-15:]
    return {"command": " ".join(cmd[1:]), "rc": rc, "seconds": time.perf_counter() - t0, "tail": tail}


def report(result: dict[str, Any]) -> None:
    rows = result["rows"]
    raw = next((r["gbps"] for n, r in rows.items() if n.startswith("raw NIXL")), None)
    d2d = rows.get("torch device-to-device copy", {}).get("gbps")
    print(f"\n{'path':<40} {'GB/s':>8} {'first':>8} {'x raw NIXL':>11} {'x D2D copy':>11} {'commit ms':>10}")
    for name, r in rows.items():
        first = f"{r['first_gbps']:8.2f}" if r.get("first_gbps") else f"{'-':>8}"
        x_raw = f"{r['gbps'] / raw:11.2f}" if raw else f"{'-':>11}"
        x_d2d = f"{r['gbps'] / d2d:11.2f}" if d2d else f"{'-':>11}"
        commit = f"{r['finish_ms']:10.1f}" if "finish_ms" in r else f"{'-':>10}"
        print(f"{name:<40} {r['gbps']:8.2f} {first} {x_raw} {x_d2d} {commit}")
    print("GB/s of a refit: discovery to prepared; 'commit ms': the finish after it (swap, or the device copy)")
    for name, target in result["targets"].items():
        print(f"target {name}: {target}")
    tests = result.get("tests")
    if tests:
        print(f"tests (rc {tests['rc']}, {tests['seconds']:.0f} s): {tests['command']}")
        for line in tests["tail"]:
            print(f"  | {line}")
    for err in result["errors"]:
        print(f"ERROR {err}")


def targets(rows: dict[str, dict[str, Any]], device: str) -> dict[str, str]:
    """The issue's GPU targets, judged on this run's figures."""
    out = {}
    d2d = rows.get("torch device-to-device copy", {}).get("gbps")
    digest = rows.get("publish: digests of every shard", {}).get("gbps")
    if d2d and digest:
        ratio = digest / d2d
        out["digests >= 0.5x device copy"] = f"{'met' if ratio >= 0.5 else 'NOT met'} ({ratio:.2f}x)"
    raw = rows.get(f"raw NIXL READ {device}->{device}", {}).get("gbps")
    for mode in ("in_place", "shadow swap", "shadow copy"):
        got = rows.get(f"refitflow {mode} {device}->{device}", {}).get("gbps")
        if raw and got:
            ratio = got / raw
            out[f"refit {mode} >= 0.8x raw NIXL READ"] = f"{'met' if ratio >= 0.8 else 'NOT met'} ({ratio:.2f}x)"
            if mode != "shadow copy":  # issue 16's, strict verify, in place and shadow
                out[f"refit {mode} >= 0.9x raw NIXL READ (issue 16)"] = f"{'met' if ratio >= 0.9 else 'NOT met'}"
    return out


def main() -> int:
    ap = argparse.ArgumentParser(prog="python bench/gpu_check.py", description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda:0", help="cuda:N (default cuda:0), or cpu for the smoke mode")
    ap.add_argument("--size-gb", type=float, default=4.0, help="model size, GB (10^9 bytes) of bf16")
    ap.add_argument("--versions", type=int, default=3)
    ap.add_argument("--budget-mb", type=float, default=1024.0, help="receiver staging budget, MiB")
    ap.add_argument("--tests", nargs="*", default=["tests/device"], help="pytest targets (none: skip the tests)")
    ap.add_argument("--tests-timeout", type=float, default=240.0)
    ap.add_argument("--row-timeout", type=float, default=120.0, help="seconds for each two-process row")
    ap.add_argument("--budget-s", type=float, default=540.0, help="skip rows that could end later than this")
    ap.add_argument("--json", default=None, help="where to write the JSON (default: $OUT/gpu_check.json)")
    args = ap.parse_args()
    deadline = time.perf_counter() + args.budget_s
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            print("no CUDA device is visible: nothing to check here (use --device cpu for the smoke mode)")
            return 2
        device = torch.device("cuda", device.index or 0)
        torch.cuda.set_device(device)
        torch.cuda.init()  # a CUDA context exists before any NIXL agent is created
    size = int(args.size_gb * 1e9)
    nbytes = synthetic_nbytes(size)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "none"
    print(f"gpu_check: device {device} ({gpu}), model {nbytes / 1e9:.3f} GB bf16, {args.versions} versions, "
          f"torch {torch.__version__}, {os.cpu_count()} CPUs, {platform.platform()}", flush=True)  # fmt: skip
    result: dict[str, Any] = {
        "device": str(device), "gpu": gpu, "nbytes": nbytes, "versions": args.versions, "torch": torch.__version__,
        "platform": platform.platform(), "rows": {}, "errors": [],
    }  # fmt: skip
    if args.tests:
        print(f"1/3 tests: pytest --device {device.type} {' '.join(args.tests)}", flush=True)
        result["tests"] = run_tests(device.type, args.tests, args.tests_timeout)
        if result["tests"]["rc"] != 0:
            result["errors"].append(f"tests failed (pytest exit {result['tests']['rc']})")
    print("2/3 copies and digests in this process", flush=True)
    try:
        result["rows"] |= local_rows(device, nbytes, size, args.versions)
    except Exception as exc:
        result["errors"].append(f"local measurements: {type(exc).__name__}: {exc}")
    print("3/3 two processes over NIXL", flush=True)
    cfg = RoleConfig(size_bytes=size, versions=args.versions, budget_bytes=int(args.budget_mb * 2**20),
                     transport="nixl", timeout_s=args.row_timeout, device=str(device))  # fmt: skip
    rows, errors = process_rows(cfg, deadline)
    result["rows"] |= rows
    result["errors"] += errors
    result["targets"] = targets(result["rows"], str(device))
    report(result)
    out = args.json or (os.path.join(os.environ["OUT"], "gpu_check.json") if os.environ.get("OUT") else None)
    if out:
        pathlib.Path(out).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(out).write_text(json.dumps(result, indent=2))
        print(f"wrote {out}")
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
