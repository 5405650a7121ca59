"""bench/gpu_check.py, the script a lent GPU machine runs, keeps working: its smoke mode runs every step on CPU."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
TINY_TEST = "tests/device/test_staging_devices.py::test_a_receiver_on_one_device_keeps_the_whole_budget_for_its_ring"


@pytest.mark.slow
def test_gpu_check_smoke_mode_runs_every_step_on_cpu(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "gpu_check.json"
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "bench/gpu_check.py", "--device", "cpu", "--size-gb", "0.05", "--versions", "2",
           "--tests", TINY_TEST, "--json", str(out)]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["errors"] == [] and result["tests"]["rc"] == 0 and "1 passed" in result["tests"]["tail"][-1]
    expected = {
        "torch device-to-device copy", "host-to-device copy (pinned)", "publish: digests of every shard",
        "raw NIXL READ cpu->cpu", "refitflow in_place cpu->cpu", "refitflow shadow swap cpu->cpu",
        "refitflow shadow copy cpu->cpu",
    }  # fmt: skip
    assert set(result["rows"]) == expected and all(r["gbps"] > 0 for r in result["rows"].values())
    assert set(result["targets"]) == {
        "digests >= 0.5x device copy", *(f"refit {m} >= 0.8x raw NIXL READ" for m in ("in_place", "shadow swap",
                                                                                        "shadow copy")),
        *(f"refit {m} >= 0.9x raw NIXL READ (issue 16)" for m in ("in_place", "shadow swap")),
    }  # fmt: skip
    assert "target refit shadow copy" in done.stdout and "commit ms" in done.stdout
