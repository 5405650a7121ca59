"""``refitflow demo`` runs end to end as a real process (small size)."""

import subprocess
import sys


def test_demo_runs_and_verifies_every_version() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "refitflow", "demo", "--size-mb", "8", "--versions", "3", "--budget-mb", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert "all versions verified and committed" in proc.stdout
    assert proc.stdout.count("in_place") == 3 and "GB/s" in proc.stdout
