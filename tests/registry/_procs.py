"""Start child processes and read their stdout lines under deadlines (for the cross-process tests)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import zmq

SRC = str(Path(__file__).resolve().parents[2] / "src")
CHILDREN = str(Path(__file__).resolve().parent / "_children.py")


async def spawn(*args: str) -> asyncio.subprocess.Process:
    env = {**os.environ, "PYTHONPATH": SRC}
    return await asyncio.create_subprocess_exec(sys.executable, *args, env=env, stdout=asyncio.subprocess.PIPE)


async def spawn_registry(*flags: str) -> tuple[asyncio.subprocess.Process, str]:
    """``refitflow registry`` in a process of its own: open (``--open``) unless ``flags`` choose keys — these
    tests send it what any client could (raw frames, restarts); CURVE is tested on its own and on the bed."""
    if not {"--open", "--keys", "--curve-secret"} & set(flags):
        flags = (*flags, "--open")
    code = "import sys; from refitflow.cli.registry_cmd import registry_main; sys.exit(registry_main(sys.argv[1:]))"
    proc = await spawn("-c", code, "--bind", "tcp://127.0.0.1:*", *flags)
    line = await line_of(proc)
    return proc, line.split(" serving at ")[1].split()[0]


async def spawn_child(role: str, address: str) -> asyncio.subprocess.Process:
    return await spawn(CHILDREN, role, address)


async def line_of(proc: asyncio.subprocess.Process) -> str:
    assert proc.stdout is not None
    line = await proc.stdout.readline()
    if not line:
        raise AssertionError(f"child {proc.pid} ended (rc {await proc.wait()}) without a line")
    return line.decode()


async def event_of(proc: asyncio.subprocess.Process) -> dict[str, Any]:
    return dict(json.loads(await line_of(proc)))


async def stop(*procs: asyncio.subprocess.Process) -> None:
    for proc in procs:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()


@contextmanager
def sync_dealer(address: str, timeout_ms: int = 5000) -> Iterator[zmq.Socket[bytes]]:
    """A blocking DEALER on ``address`` whose receive fails (``zmq.Again``) after ``timeout_ms``."""
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        yield sock
    finally:
        ctx.destroy(linger=0)
