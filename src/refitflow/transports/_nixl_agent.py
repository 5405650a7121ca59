"""One NIXL agent behind a lock, progressed by a cheap thread, with its errors made ``TransportError``.

NIXL's default thread-sync mode does no locking, and one agent driven from two threads at once
crashes (SIGSEGV). Every call here goes through one ``threading.Lock``; the progress thread only
*tries* the lock, so it never queues behind a long copy. It calls ``get_new_notifs()`` every few
milliseconds, which is what a data owner must do for connection wire-up (NIXL's own progress
thread would spin a core instead), and counts the bytes peers read from it: a reader posts every
READ with the notification ``SERVED_PREFIX + str(nbytes)``, which the owner receives once the
transfer is done. Such a READ completes only once the owner progresses, so while peers read the
thread runs every 0.5 ms (a reader of many small buckets waited up to 5 ms on each), and backs off
to ``progress_interval_s`` when they stop (idle, a 5 ms period costs ~1% of a core, 0.5 ms ~6%).

Once the agent holds device memory (VRAM), every call first binds that device's primary CUDA context
to the calling thread (``bind_cuda``): UCX's CUDA transports call the driver from whichever thread
drives the agent, and a thread with no current context crashes it (nixl issue #2102).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from refitflow.core.errors import ConfigError, TransportError

__all__ = ["SERVED_PREFIX", "LockedAgent", "bind_cuda", "dead_peer_config", "load_nixl"]

SERVED_PREFIX = b"rf-served:"
READING = b"rf-reading"  # a reader about to read: its owner keeps progressing often (TCP GETs need the owner)
BUSY_INTERVAL_S = 5e-4  # the progress thread's period while peers read from the agent
BUSY_HOLD_S = 0.25  # ... and for this long after the last notification, before it backs off
ANNOUNCE_EVERY_S = 0.05  # a peer is told reads are coming at most this often (well inside BUSY_HOLD_S)


def load_nixl() -> Any:
    """Import nixl (optional dependency) and silence its stdout logger."""
    try:
        import nixl
    except ImportError as exc:
        raise ConfigError("the nixl transport needs the nixl package: pip install 'refitflow[nixl]'") from exc
    logging.getLogger("nixl").setLevel(logging.WARNING)
    return nixl


def bind_cuda(device: int) -> None:
    """Make ``device``'s primary CUDA context current in this thread (cheap once it is; the current
    device is left as it was)."""
    import torch

    torch.cuda.current_stream(device).query()  # a runtime call under a device guard binds the context


def dead_peer_config(seconds: float | None) -> str:
    """UCX settings (NIXL's ``engine_config``) under which a TCP connection to a peer that stopped answering —
    unplugged, its host gone, a network partition — fails within about ``seconds``: unacknowledged data for
    that long (``TCP_USER_TIMEOUT``), or an idle connection's keepalive probes unanswered. UCX's own defaults
    left a READ posted into a partition in progress indefinitely (measured on simulated hosts: none had ended
    after 100 s), and a READ on the wire cannot be cancelled: its memory would wait as long
    (``_nixl_flights``). They take precedence over ``UCX_TCP_*`` in the environment; None: none (UCX's
    settings, the environment's). RDMA transports have their own (``UCX_RC_TIMEOUT``, ``UCX_RC_RETRY_COUNT``)."""
    if seconds is None:
        return ""
    whole = max(2, round(seconds))
    idle = whole // 2
    return f"TCP_USER_TIMEOUT={whole}s,TCP_KEEPIDLE={idle}s,TCP_KEEPINTVL=1s,TCP_KEEPCNT={max(1, whole - idle)}"


class LockedAgent:
    def __init__(self, name: str, *, progress_interval_s: float = 0.005, dead_peer_s: float | None = 5.0) -> None:
        nixl = load_nixl()
        from nixl._api import nixl_agent, nixl_agent_config

        bindings = nixl._bindings
        self.errors: tuple[type[BaseException], ...] = tuple(
            getattr(bindings, n) for n in dir(bindings) if n.startswith("nixl") and n.endswith("Error")
        )
        self.disconnected: type[BaseException] = bindings.nixlRemoteDisconnectError
        self.name = name
        self.lock = threading.Lock()
        self.interval = progress_interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.served = 0  # bytes peers reported reading from this agent
        self._announced: dict[str, float] = {}  # peer -> when it was last told a read is coming
        self.cuda: int | None = None  # the device of its first VRAM registration (see bind_cuda)
        config = nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False, backends=[])
        with self.translated("agent creation"):
            self.agent = nixl_agent(name, config)
            ucx = dead_peer_config(dead_peer_s)
            self.agent.create_backend("UCX", {"engine_config": ucx} if ucx else {})

    @contextlib.contextmanager
    def translated(self, what: str) -> Iterator[None]:
        try:
            yield
        except self.errors as exc:
            raise self._error(what, exc) from exc

    def _error(self, what: str, exc: BaseException) -> TransportError:
        reason = "peer disconnected" if isinstance(exc, self.disconnected) else str(exc)
        return TransportError(f"nixl {what} failed: {type(exc).__name__}: {reason}")

    def call(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on the agent, under the lock, errors translated (inline, not ``translated``: a poster
        thread calls this for every READ it posts and checks)."""
        with self.lock:
            try:
                if self.cuda is not None:
                    bind_cuda(self.cuda)
                return fn(*args)
            except self.errors as exc:
                raise self._error(what, exc) from exc

    def start_progress(self) -> None:
        if self._thread is None and not self._stop.is_set():
            self._thread = threading.Thread(target=self._progress, name=f"nixl-progress-{self.name}", daemon=True)
            self._thread.start()

    def _progress(self) -> None:
        """Every ``interval`` while idle; every ``BUSY_INTERVAL_S`` while peers are reading and for
        ``BUSY_HOLD_S`` after their last notification (a READ posted with a notification completes only once
        its owner progresses: a reader of many buckets would wait for this thread at each; over TCP, UCX
        emulates a READ with messages the owner's worker must answer — measured on simulated hosts, a 5 ms
        period held a read to ≈ 0.7 GB/s — and readers announce themselves with ``READING`` first), backing
        off again by doubles once they stop."""
        wait, busy_until = self.interval, 0.0
        while not self._stop.wait(wait):
            if not self.lock.acquire(blocking=False):
                wait = BUSY_INTERVAL_S  # someone else is driving the agent: that progresses it too
                continue
            try:
                if self._take_notifs():
                    busy_until = time.monotonic() + BUSY_HOLD_S
            finally:
                self.lock.release()
            wait = BUSY_INTERVAL_S if time.monotonic() < busy_until else min(wait * 2, self.interval)

    def announce(self, peers: set[str]) -> None:
        """Tell each peer a read from it is coming (``READING``): its progress thread speeds up. Once per
        ``ANNOUNCE_EVERY_S`` a peer at most: the owner stays fast for ``BUSY_HOLD_S`` after a notification, and a
        notification a bucket cost a reader of small buckets 15 µs each."""
        now = time.monotonic()
        for peer in peers:
            if now - self._announced.get(peer, -1e9) < ANNOUNCE_EVERY_S:
                continue
            self._announced[peer] = now
            try:
                self.call("send_notif", self.agent.send_notif, peer, READING)
            except TransportError:
                pass  # the read itself will say what is wrong with that peer

    def _take_notifs(self) -> bool:
        """Under the lock: progress the agent (wire-up) and count served-bytes notifications; whether any came."""
        try:
            if self.cuda is not None:
                bind_cuda(self.cuda)
            notifs = self.agent.get_new_notifs()
        except self.errors:
            return False  # a dead peer's failed wire-up: readers see it on their own transfers
        for messages in notifs.values():
            for m in messages:
                if m.startswith(SERVED_PREFIX):
                    try:
                        self.served += int(m[len(SERVED_PREFIX) :])
                    except ValueError:
                        pass  # not ours
        return bool(notifs)

    def drain(self) -> int:
        """Count the notifications that arrived so far (waits for the lock); the bytes served."""
        with self.lock:
            self._take_notifs()
        return self.served

    def stop_progress(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
            self._thread = None

    def close(self) -> None:
        """Drop the agent now (its UCX workers, sockets and event fds go with it), not whenever the last
        reference to this object is collected (a traceback held by a caught error kept ten fds alive)."""
        self.stop_progress()
        with self.lock:
            self.agent = None
