"""``refitflow demo`` runs end to end as a real command (small size): processes over NIXL, and in-process."""

import subprocess
import sys

import pytest


@pytest.mark.parametrize("transport", ["nixl", "loopback"])
def test_demo_runs_and_verifies_every_version(transport: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "refitflow", "demo", "--size-mb", "20", "--versions", "3", "--budget-mb", "1",
         "--transport", transport],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    out = proc.stdout
    assert proc.returncode == 0, proc.stderr[-3000:] + out[-3000:]
    assert "all versions verified and committed on every receiver" in out
    for version in (1, 2, 3):
        assert out.count(f"v{version} published") == 1
    assert out.count("verified, committed") == 6  # 2 receivers x 3 versions
    assert out.count("/metrics") == 2 and "per-stage busy time" in out


def test_registry_and_keys_subcommands_have_help() -> None:
    for sub in ("registry", "keys"):
        proc = subprocess.run([sys.executable, "-m", "refitflow", sub, "--help"], capture_output=True, text=True,
                              timeout=60)  # fmt: skip
        assert proc.returncode == 0 and "usage: refitflow " + sub in proc.stdout
