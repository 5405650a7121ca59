"""The ``refitflow`` command as a user meets it: the demo end to end (real processes), arguments, help, version."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

import refitflow as rf
from refitflow.cli.main import main
from tests._keys import KEYS


def _refitflow(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "refitflow", *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("transport", ["nixl", "loopback"])
def test_default_demo_refits_a_real_model_from_megatron_into_fused_engines(transport: str) -> None:
    proc = _refitflow("demo", *(["--transport", transport] if transport == "loopback" else []))
    out = proc.stdout
    assert proc.returncode == 0, proc.stderr[-3000:] + out[-3000:]
    assert "all versions verified and committed on every receiver" in out
    if transport == "nixl":  # processes around a registry service: CURVE, with the deployment's keys
        assert f"CURVE on: keys in {KEYS.folder}" in out
    assert "trainer: Megatron layout, TP 2" in out and "engine tp2: vLLM fused layout, TP 2" in out
    early = [("announced early" in line) for line in out.splitlines() if re.match(r"v\d published", line.strip())]
    assert early == [False, False, True], out  # auto two-phase: once a version changed every byte
    for version in (1, 2, 3):
        assert out.count(f"v{version} published") == 1
        for engine in ("tp1", "tp2"):  # the engines' logits after each version: the trainer's, bit for bit
            assert f"v{version} engine {engine}: logits (2×16×1024) = the trainer's, bit-exact" in out
    assert out.count("verified, committed") == 9  # 3 ranks (TP 1 + TP 2) x 3 versions
    pulled = re.findall(r"pulled +([\d.]+) MB (?:\+ ([\d.]+) MB unchanged )?for a +([\d.]+) MB slice", out)
    assert len(pulled) == 9 and all(float(p) + float(k or 0) >= float(s) > 0 for p, k, s in pulled)
    slices = {name: float(s) for name, s in re.findall(r"v3 (tp\S+) +pulled .* for a +([\d.]+) MB", out)}
    assert slices["tp2/r0"] == slices["tp2/r1"] and abs(2 * slices["tp2/r0"] - slices["tp1"]) < 0.01
    # the table's header is one line: a pipe is not cut to 80 columns
    header = next(line for line in out.splitlines() if "discover" in line and "GB/s (best)" in line)
    assert all(column in header for column in ("plan", "pull", "verify", "commit", "pulled MB", "slice MB"))


@pytest.mark.parametrize("transport", ["nixl", "loopback"])
def test_synthetic_demo_runs_and_verifies_every_version(transport: str) -> None:
    proc = _refitflow("demo", "--model", "synthetic", "--size-mb", "20", "--versions", "3", "--budget-mb", "1",
                      "--transport", transport, timeout=180)  # fmt: skip
    out = proc.stdout
    assert proc.returncode == 0, proc.stderr[-3000:] + out[-3000:]
    assert "all versions verified and committed on every receiver" in out
    for version in (1, 2, 3):
        assert out.count(f"v{version} published") == 1
    assert "announced early" in out.split("v3 published")[1].splitlines()[0], out  # v2 changed every byte
    assert "announced early" not in out.split("v3 published")[0]
    assert out.count("verified, committed") == 6  # 2 receivers x 3 versions
    assert out.count("/metrics") == 2 and "per-stage busy time" in out


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["demo", "--versions", "0"], "argument --versions: must be above zero, got 0"),
        (["demo", "--versions", "two"], "argument --versions: 'two' is not a whole number"),
        (["demo", "--budget-mb", "0"], "argument --budget-mb: must be above zero, got 0"),
        (["demo", "--model", "synthetic", "--size-mb", "-5"], "argument --size-mb: must be above zero, got -5"),
        (["demo", "--size-mb", "5"], "--size-mb applies to --model synthetic only"),
        (["demo", "--transport", "tcp"], "argument --transport: invalid choice: 'tcp'"),
        (["demo", "--timeout-s", "-1"], "argument --timeout-s: must be above zero"),
        (["demo", "--budget-mb", "0.00001"], "a budget of at least 64 bytes"),
        (["registry", "--bind", "127.0.0.1:7100"], "did you mean 'tcp://127.0.0.1:7100'"),
        (["registry", "--lease-s", "0"], "argument --lease-s: must be above zero"),
        (["registry", "--curve-secret", "k"], "--curve-secret and --curve-authorized go together"),
    ],
)
def test_every_bad_argument_is_a_one_line_error(capsys, args: list[str], says: str) -> None:
    try:
        code = main(args)
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2
    assert says in err and err.count("\n") == 1, err


def test_help_shows_every_default_and_version_prints_it(capsys) -> None:
    for args in (["demo", "--help"], ["registry", "--help"], ["keys", "--help"]):
        with pytest.raises(SystemExit):
            main(args)
        help_text = " ".join(capsys.readouterr().out.split())
        assert "usage: refitflow " + args[0] in help_text
        if args[0] == "demo":
            for default in ("tiny-llama", "3", "256.0", "nixl", "300.0"):
                assert f"(default: {default})" in help_text
        if args[0] == "registry":
            assert "(default: tcp://127.0.0.1:7100)" in help_text and "(default: 10)" in help_text
    proc = _refitflow("--version", timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == f"refitflow {rf.__version__}"
