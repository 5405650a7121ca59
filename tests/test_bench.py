"""``python -m bench --quick`` runs end to end: every row, with positive figures and bit-exact results (no timings)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from refitflow.core.wire import PROTOCOL_VERSION

ROOT = pathlib.Path(__file__).resolve().parents[1]
TRANSFERS = {  # every row that moves the trainer's bytes into a receiving process
    "raw NIXL READ into the parameters (no pipeline)",
    "refitflow over NIXL, in place",
    "refitflow over NIXL, shadow",
    "refitflow over NIXL, in place, announced early",
    "gloo broadcast into the parameters (per tensor)",
    "gloo packed 64 MiB buckets, reused (NCCL shape)",
    "/dev/shm safetensors: save, open, copy in",
}
END_TO_END = TRANSFERS - {"raw NIXL READ into the parameters (no pipeline)"}
RECEIVER_ONLY = {"raw NIXL READ into the parameters (no pipeline)", "refitflow over NIXL, in place",
                 "refitflow over NIXL, shadow", "refitflow over NIXL, in place, announced early"}  # fmt: skip


@pytest.mark.slow
def test_bench_quick_reports_every_row_bit_exact(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "bench.json"
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "bench", "--quick", "--json", str(out)]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = result["rows"]
    threads = result["machine"]["torch_threads"]
    assert set(rows) == TRANSFERS | {"memcpy, 1 thread (limit)", f"memcpy, torch's default {threads} threads"}
    assert result["versions"] == 2 and result["nbytes"] > 0 and len(result["load_before"]) == 3
    for name in TRANSFERS:
        row = rows[name]
        assert row["exact"] is True, f"{name}: the receiver's weights differ from the trainer's"
        assert row["trainer_rss"] > 0 and row["receiver_rss"] > 0 and row["peak_staging"] >= 0, (name, row)
    assert all(rows[name]["e2e_gbps"] > 0 for name in END_TO_END)
    assert all(rows[name]["receiver_gbps"] > 0 for name in RECEIVER_ONLY)
    assert rows["memcpy, 1 thread (limit)"]["receiver_gbps"] > 0
    assert rows["gloo packed 64 MiB buckets, reused (NCCL shape)"]["peak_staging"] > 0  # its receiver's bucket
    for name in RECEIVER_ONLY - {"raw NIXL READ into the parameters (no pipeline)"}:
        assert len(rows[name]["e2e_seconds"]) == 2 and all(s > 0 for s in rows[name]["e2e_seconds"])
        pairs = zip(rows[name]["e2e_seconds"], rows[name]["receiver_seconds"], strict=True)
        assert all(e2e > recv for e2e, recv in pairs), f"{name}: publish→commit must contain the receiver's part"
        t = rows[name]["timeline"]  # the last version, ms from the trainer's go: every byte read, in order
        assert sum(n for _, _, n in t["reads"]) == result["nbytes"], (name, t)
        found, committed = t["found_ms"], t["committed_ms"]  # two clocks' roundings: 0.1 ms of slack
        assert 0 < found < committed and all(found - 0.1 <= a <= b <= committed + 0.1 for a, b, _ in t["reads"]), t
    assert set(result["ratios"]) and all(x > 0 for x in result["ratios"].values())
    assert "publish→commit" in done.stdout and "load average" in done.stdout


@pytest.mark.parametrize("receiver", ["tp16", "dp16"])
def test_the_kimi_plan_bench_runs_small_and_pulls_about_each_ranks_slice(receiver: str) -> None:
    """The bench's shape-only publication keeps pace with the manifest format (it once fell behind it)."""
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, str(ROOT / "bench" / "kimi_plan_bench.py"), "--layers", "3", "--experts", "16",
           "--receiver", receiver, "--ranks", "0,15", "--digests"]  # fmt: skip
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, check=True).stdout
    rows = [line.split("; digests")[0].split() for line in out.splitlines() if "pulled for a" in line]
    assert len(rows) == 2, out
    for row in rows:
        pulled, ideal = float(row[row.index("pulled") - 2]), float(row[row.index("slice") - 2])
        assert 0 < ideal <= pulled <= 1.1 * ideal, out
    assert out.count("digests a version") == 2, out  # a rank's digests decode (--digests)


def test_registry_bench_runs_at_a_small_size() -> None:
    """The registry bench publishes manifests as the wire carries them: one written against an older
    manifest format was refused by the registry, and nothing noticed until it was run again."""
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "bench/registry_bench.py", "--sources", "16", "--tensors", "20", "--clients", "4",
           "--queries", "2"]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "published 16 sources × 20 tensors" in done.stdout, done.stdout
    assert f"protocol v{PROTOCOL_VERSION}" in done.stdout, done.stdout
    assert "cold discovery (fetch 8 manifests, 160 shards)" in done.stdout and "warm discovery" in done.stdout


def test_the_etcd_registry_bench_runs_at_a_small_size() -> None:
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "bench/registry_etcd_bench.py", "--receivers", "8", "--tensors", "10", "--members", "1"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [line.split() for line in done.stdout.splitlines() if "ops/s" in line]
    assert [r[0] for r in rows] == ["join", "fetch", "relay", "release", "heartbeat"] * 2, done.stdout
    assert "60000 tensors: 1.31 MB in etcd, 2 chunk(s)" in done.stdout, done.stdout


def test_digest_bench_runs_at_a_small_size() -> None:
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "bench/digest_bench.py", "--size-mb", "8", "--rounds", "1", "--ranks", "2"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.endswith("GB/s")]
    assert len(rows) == 4 and all(float(r.split()[-2]) > 0 for r in rows), done.stdout


def test_the_manifest_and_registry_scale_benches_run_at_a_small_size() -> None:
    """The column wire form's bench and the 1,000-receiver registry bench, tiny, against this tree alone."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "REFITFLOW_KEYS": "open"}
    cmd = [sys.executable, "bench/manifest_bench.py", "--shards", "200", "--rounds", "1", "--baseline", ""]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "parse (bytes → Manifest)" in done.stdout, done.stdout + done.stderr[-3000:]
    cmd = [sys.executable, "bench/registry_scale_bench.py", "--receivers", "6", "--tensors", "64", "--workers", "1",
           "--versions", "2"]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.count("registry CPU") == 2 and "GB moved" in done.stdout, done.stdout


def test_the_calibrations_fanout_and_relay_benches_run_small_bit_exact_with_their_cpu() -> None:
    """``bench/fanout_bench.py`` (every receiver's bytes checked once the row is over: ``ReceiverProc.check``) and
    ``bench/relay_cost.py``, tiny, print what the calibration reads: each row's receivers' CPU, a status read's."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    cmd = [sys.executable, "bench/fanout_bench.py", "--together", "1,2", "--tensors", "8", "--numel", "20000",
           "--frozen", "0"]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]  # the bench asserts every check
    rows = [line.split() for line in done.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert [r[0] for r in rows] == ["1", "2"] and all(len(r) == 7 for r in rows), done.stdout
    assert [r[1] for r in rows] == ["1.00", "1.00"]  # relaying: one copy of the trainer's bytes however many read
    assert all(float(r[6]) > 0 for r in rows), done.stdout  # CPU ms a receiver
    cmd = [sys.executable, "bench/relay_cost.py", "--size-mb", "2", "--tensors", "64", "--buckets", "4", "8",
           "--rounds", "1"]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "a relayed bucket's own" in done.stdout and "a status read's CPU" in done.stdout, done.stdout


@pytest.mark.parametrize("bound", [True, False])
def test_the_prepared_memory_bench_keeps_two_relays_preparations_unless_unbounded(bound: bool) -> None:
    """``bench/prepared_memory.py``, tiny: a key read from a new relay each version keeps its last two relays'
    transfers (every byte checked by the bench), and every relay's with ``--unbounded`` (the code before)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    cmd = [sys.executable, "bench/prepared_memory.py", "--relays", "4", "--buckets", "3", "--descs", "20",
           "--versions", "6", *([] if bound else ["--unbounded"])]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [line.split() for line in done.stdout.splitlines() if line.strip()[:1].isdigit()]
    kept = [int(r[3]) for r in rows]
    assert kept == ([3, 6, 6, 6, 6, 6] if bound else [3, 6, 9, 12, 12, 12]), done.stdout
    prepared = [int(r[2]) for r in rows]
    assert prepared == ([3, 6, 9, 12, 15, 18] if bound else [3, 6, 9, 12, 12, 12]), done.stdout  # bound: again
