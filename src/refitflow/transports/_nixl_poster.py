"""A thread per agent that posts submitted READs back to back and says when each batch ended (``submit``).

The event loop hands a batch of prepared transfers (one bucket's, to every peer it reads) to the poster's queue
and goes on; the poster posts each batch as it comes (over cma ``transfer()`` performs the copy itself), checks
the READs still in progress — spinning for the first few checks (a READ that comes back pending is often done
within microseconds: a sleep, at least ~60 µs on Linux, would dominate it), then sleeping up to 200 µs between
checks, but taking new batches as soon as they come — and calls each batch's ``done`` with its states once every
READ of it has ended. Batches are checked in order up to the first one still in progress: checking a READ
progresses the agent's worker, which moves every READ in flight, and readers land buckets in order anyway (a
check of every batch in flight each pass was 8 checks a READ, each taking the GIL); a batch in progress for
longer than ``HOLD_S`` (a peer that stopped answering) no longer holds back the checks of those after it.
Buckets thus stay in flight without a thread hop each: the loop is woken once per batch that ended
(``core.threads.waker``), and batches that end together are handled in one pass of the loop.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from refitflow.core.errors import TransportError
from refitflow.transports._nixl_agent import LockedAgent

__all__ = ["Poster"]

SPIN_CHECKS = 4  # checks of pending READs before the poster starts sleeping between them
POLL_MAX_S = 2e-4  # the longest sleep between checks of pending READs
HOLD_S = 1e-3  # a batch in progress this long no longer holds back the checks of later ones
State = str | TransportError
Done = Callable[[list[State]], object]


class _Batch:
    __slots__ = ("done", "pending", "posted", "posts", "states")

    def __init__(self, posts: list[tuple[Any, bytes]], done: Done) -> None:
        self.posts = posts
        self.done = done
        self.states: list[State] = []
        self.pending: list[int] = []
        self.posted = 0.0  # perf_counter when posted


_STOP = object()


class Poster:
    """Posts ``submit``ted batches of one ``LockedAgent`` from a thread of its own (started on first use)."""

    def __init__(self, nx: LockedAgent) -> None:
        self.nx = nx
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, posts: list[tuple[Any, bytes]], done: Done) -> None:
        """Post each ``(transfer handle, notification)``; ``done(states)`` is called from the poster's thread once
        every one has ended (``"DONE"``, another final state, or the ``TransportError`` its post or check raised)."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"nixl-poster-{self.nx.name}", daemon=True)
                self._thread.start()
        self._queue.put(_Batch(posts, done))

    def close(self) -> None:
        """Stop the thread once what was submitted has ended (a batch still pending ends as an error)."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(_STOP)
            thread.join(timeout=5.0)

    def _run(self) -> None:
        outstanding: list[_Batch] = []
        idle = 0  # checks since the last progress
        while True:
            item: Any = None
            try:
                if not outstanding:
                    item = self._queue.get()
                elif idle < SPIN_CHECKS:
                    item = self._queue.get_nowait()
                else:
                    item = self._queue.get(timeout=min(POLL_MAX_S, 1e-5 * 2 ** min(idle - SPIN_CHECKS, 5)))
            except queue.Empty:
                pass
            if item is _STOP:
                for b in outstanding:
                    b.states = [TransportError("nixl transport closed with this READ in progress")] * len(b.posts)
                    b.done(b.states)
                return
            progressed = False
            if item is not None:
                self._post(item)
                outstanding.append(item)
                progressed = True
            now = time.perf_counter()
            for b in outstanding:
                progressed |= self._check(b)
                if b.pending and now - b.posted < HOLD_S:
                    break  # the later ones wait behind it (see the module's docstring)
            for b in [b for b in outstanding if not b.pending]:
                b.done(b.states)
            outstanding = [b for b in outstanding if b.pending]
            idle = 0 if progressed else idle + 1

    def _post(self, b: _Batch) -> None:
        nx = self.nx
        b.posted = time.perf_counter()
        for i, (handle, notif) in enumerate(b.posts):
            try:
                state: State = str(nx.call("transfer", nx.agent.transfer, handle, notif))
            except TransportError as exc:
                state = exc
            b.states.append(state)
            if state == "PROC":
                b.pending.append(i)

    def _check(self, b: _Batch) -> bool:
        """Check the batch's pending READs; whether any ended."""
        nx, left = self.nx, []
        for i in b.pending:
            try:
                state: State = str(nx.call("check_xfer_state", nx.agent.check_xfer_state, b.posts[i][0]))
            except TransportError as exc:
                state = exc
            if state == "PROC":
                left.append(i)
            else:
                b.states[i] = state
        ended = len(left) < len(b.pending)
        b.pending = left
        return ended
