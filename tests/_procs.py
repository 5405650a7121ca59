"""Child processes of the multi-process tests: never outlive a test, and say where one hung.

A child calls ``dumpable()`` first thing; ``reap(procs)`` joins every child, and for one still alive
after ``timeout`` seconds it first asks for every thread's stack (faulthandler, on SIGUSR1: printed
to the child's stderr, which pytest shows with the failure), then kills it.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import time
from collections.abc import Iterable
from typing import Any


def dumpable() -> None:
    """In a child: print every thread's stack on SIGUSR1."""
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)


def reap(procs: Iterable[Any], timeout: float = 20.0) -> list[int]:
    """Join every process; the indexes of those that had to be killed (their stacks printed first)."""
    procs = list(procs)
    hung = []
    for i, p in enumerate(procs):
        p.join(timeout=timeout)
        if p.exitcode is None:
            hung.append(i)
            os.kill(p.pid, signal.SIGUSR1)
            time.sleep(1.0)  # the child writes its stacks
            p.kill()
            p.join(timeout=5)
    return hung
