"""The loop thread of the integrations: a host process that never closes it still exits."""

from __future__ import annotations

import subprocess
import sys

CODE = """
from refitflow.integrations.hosting.loop_thread import LoopThread

async def answer() -> int:
    return 42

loop = LoopThread("left-open")  # held to the end, never closed
print(loop.run(answer, timeout=10))
"""


def test_a_process_that_leaves_its_loop_thread_open_still_exits() -> None:
    done = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "42"
