"""A role of the soak (``bench/soak.py``) in its own process, speaking ``SOAK <json>`` lines on stdout."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import anyio
from anyio.abc import Process
from anyio.streams.buffered import BufferedByteReceiveStream

__all__ = ["PREFIX", "Child"]

PREFIX = "SOAK "
SRC = str(Path(__file__).resolve().parents[1] / "src")
ROOT = str(Path(__file__).resolve().parents[1])


class Child:
    """A role in its own process, speaking ``SOAK <json>`` lines on stdout."""

    def __init__(self, *args: str) -> None:
        self.args = args
        self.proc: Process | None = None
        self.pids: list[int] = []  # every process started for this role
        self.lines: list[dict[str, Any]] = []
        self._new = anyio.Event()  # set at each line
        self._log = tempfile.NamedTemporaryFile(prefix=f"soak-{args[0]}-", suffix=".log")  # every start's stderr
        self._killed = False  # the driver ended the process it runs now (a fault, or the end)

    async def start(self, tg: anyio.abc.TaskGroup) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([SRC, ROOT]))
        env.setdefault("UCX_NET_DEVICES", "lo")
        argv = [sys.executable, "-X", "faulthandler", "-m", "bench.soak", "--role", *self.args]  # a crash's stack
        self.proc = await anyio.open_process(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                             env=env)  # fmt: skip
        self.pids.append(self.proc.pid)
        self._killed = False
        ready = anyio.Event()
        tg.start_soon(self._read, self.proc, ready)
        with anyio.fail_after(60):
            await ready.wait()

    async def _read(self, proc: Process, ready: anyio.Event) -> None:
        assert proc.stdout is not None
        out = BufferedByteReceiveStream(proc.stdout)
        with contextlib.suppress(anyio.EndOfStream, anyio.IncompleteRead, anyio.ClosedResourceError):
            while True:
                line = (await out.receive_until(b"\n", 1 << 20)).decode()
                if line.startswith(PREFIX):
                    msg = json.loads(line[len(PREFIX) :])
                    if msg.get("ready"):
                        ready.set()
                    self.lines.append(msg)
                    self._new.set()
                    self._new = anyio.Event()

    async def send(self, cmd: dict[str, Any]) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        await self.proc.stdin.send(json.dumps(cmd).encode() + b"\n")

    async def wait_line(self, key: str, value: Any, timeout: float) -> bool:
        with anyio.move_on_after(timeout):
            while not any(m.get(key) == value for m in self.lines):
                await self._new.wait()
            return True
        return False

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.returncode is None:
            os.kill(self.proc.pid, sig)

    def crashed(self) -> str | None:
        """How the process ended, with its stderr's last lines, if it ended without the driver ending it."""
        if self.proc is None or self.proc.returncode is None or self._killed:
            return None
        self._log.flush()
        said = Path(self._log.name).read_bytes().decode(errors="replace").split("\nExtension modules:")[0]
        tail = said[-1500:]
        return f"{' '.join(self.args[:2])} exited {self.proc.returncode}: {tail}"

    async def kill(self) -> None:
        self._killed = True
        if self.proc is not None:
            if self.proc.returncode is None:
                self.proc.kill()
            with anyio.CancelScope(shield=True):
                await self.proc.wait()

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid
