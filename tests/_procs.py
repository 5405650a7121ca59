"""Child processes of the multi-process tests: never outlive a test, and say where one hung.

A child calls ``dumpable()`` first thing; ``reap(procs)`` joins every child, and for one still alive
after ``timeout`` seconds it first asks for every thread's stack (faulthandler, on SIGUSR1: printed
to the child's stderr, which pytest shows with the failure), then kills it. ``ends_within`` runs a
call that might block its thread for good (a ZMQ ``term()``) where a hang fails the test instead.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable
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


def ends_within(fn: Callable[[], object], seconds: float) -> BaseException | None:
    """Run ``fn()`` in a daemon thread of its own; assert it ended within ``seconds``; what it raised, if
    anything."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:
            raised.append(exc)

    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    runner.join(seconds)
    assert not runner.is_alive(), f"{fn} did not end within {seconds} s"
    return raised[0] if raised else None
