"""The README's examples run exactly as written: the one-process quick start, and the three processes."""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README.read_text(), re.S)


def test_readme_quick_start_runs_as_written() -> None:
    quick = [b for b in _blocks("python") if "rf.Receiver(" in b and "rf.Registry()" in b]
    assert quick, "README has no quick-start block"
    namespace: dict = {"__name__": "__quickstart__"}
    exec(compile(quick[0], str(README), "exec"), namespace)  # raises if any assert in it fails
    assert "main" in namespace


def test_readme_cross_process_example_runs_as_written(tmp_path: pathlib.Path) -> None:
    """The registry CLI, trainer.py and server.py, as real processes, with the README's own commands.

    They run in a private network namespace (``unshare``, as root or in a user namespace) so that the
    README's fixed port 7100 cannot clash with anything else on the machine.
    """
    scripts = {m[1]: b for b in _blocks("python") if (m := re.match(r"# (\w+\.py) ", b))}
    assert set(scripts) == {"trainer.py", "server.py"}, "README's cross-process example lost a script"
    for name, text in scripts.items():
        (tmp_path / name).write_text(text)
    commands = [b for b in _blocks("bash") if "python trainer.py" in b]
    assert len(commands) == 1
    (tmp_path / "run.sh").write_text(commands[0])
    assert shutil.which("unshare") and shutil.which("ip"), "the test needs util-linux's unshare and iproute2's ip"
    src = str(pathlib.Path(__file__).resolve().parents[1] / "src")
    env = {
        **{k: v for k, v in os.environ.items() if k != "REFITFLOW_KEYS"},
        "HOME": str(tmp_path),
        "PATH": f"{pathlib.Path(sys.executable).parent}:{os.environ['PATH']}",
        "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]),
    }  # a fresh user: no keys yet
    proc = subprocess.Popen(
        ["unshare", "--net", "--map-root-user", "bash", "-c", "ip link set lo up && bash run.sh"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=240)
    finally:  # whatever happened, nothing the example started outlives the test
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert proc.returncode == 0, err[-3000:] + out[-3000:]
    trainer = dict(re.findall(r"trainer: published v(\d), output (\S+)", out))
    server = dict(re.findall(r"server: committed v(\d) \(\d+ bytes\), output (\S+)", out))
    assert sorted(trainer) == sorted(server) == ["1", "2", "3"], out
    assert server == trainer, out  # the server computes what the trainer computed, version by version
    assert (tmp_path / ".refitflow" / "keys" / "server.key_secret").is_file()  # authenticated, as written
    assert len(set(trainer.values())) == 3  # and each version differs: the training steps changed the weights
