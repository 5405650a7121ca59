"""The GIL and the cyclic collector around CPU-bound Python in worker threads, for an event loop beside them.

``building``/``built``: builders of per-plan structures (tens of thousands of acyclic objects) run with the
collector paused and a 1 ms switch interval; ``off_loop``: a builder in a worker thread, one at a time per
event loop; ``breathe``/``let_go``: long loops give the GIL away about every millisecond; ``waker``: a thread
that is not the loop's hands it a callback without waiting for it. Process-wide, used by stages and transports
alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import anyio.to_thread
import sniffio
from anyio import CapacityLimiter
from anyio.lowlevel import RunVar

__all__ = ["breathe", "building", "built", "let_go", "off_loop", "waker"]

T = TypeVar("T")

_build_lock = threading.Lock()
_builders = [0, False, 0.005]  # holders; whether the collector was enabled and the switch interval before the first
_SWITCH_S = 0.001  # the interpreter's switch interval while a builder runs


@contextlib.contextmanager
def building() -> Iterator[None]:
    """While a worker thread builds what a plan needs (restored after; nested and threads ok):

    - the cyclic garbage collector is paused. Building allocates about a hundred acyclic objects per
      tensor; with a big model resident, the collector's full passes over every live object were half
      of the build time, and each pass holds the GIL for tens of milliseconds (event-loop lag);
    - the interpreter's switch interval is at most 1 ms, so the event loop's thread waits at most that
      long for the GIL while a builder's Python runs (at the default 5 ms, ticks of a loop beside a
      first refit of 10,000 tensors came late by 5–9 ms at the 99th percentile). A process that sets
      the interval itself while a plan is being built has it restored to the value before;
    - when the collector comes back, what the builders made joins the oldest generation without a pass
      over it (``_promote_young``): the young generation's count had grown by every object made meanwhile,
      so the first allocation after ``gc.enable()`` ran a pass over all of them (5–7 ms holding the GIL,
      collecting nothing, at the end of a 10,000-tensor plan: the first refit's latest loop ticks).
    """
    with _build_lock:
        if _builders[0] == 0:
            _builders[1] = gc.isenabled()
            _builders[2] = sys.getswitchinterval()
            gc.disable()
            sys.setswitchinterval(min(_builders[2], _SWITCH_S))
        _builders[0] += 1
    try:
        yield
    finally:
        with _build_lock:
            _builders[0] -= 1
            if _builders[0] == 0:
                sys.setswitchinterval(_builders[2])
                if _builders[1]:
                    _promote_young()
                    gc.enable()


_PROMOTE_AT = 2_000  # young objects: more only where builders made them (a warm refit's verify makes ≈ 300–500)


def _promote_young() -> None:
    """After builders made many objects, every tracked object into the oldest generation without a pass:
    ``freeze`` moves them all to the permanent generation (and zeroes the young count), ``unfreeze`` moves
    them back into the oldest, both O(1). A plan's objects are long-lived and acyclic (refcounting frees
    them); the process's own young cycles wait for the next full pass, so this happens only when a pass
    would be long (a first refit's plan, not a warm refit's verify) — and never when the process froze
    objects itself (``unfreeze`` would undo that)."""
    if gc.get_count()[0] > _PROMOTE_AT and gc.get_freeze_count() == 0:
        gc.freeze()
        gc.unfreeze()


def built(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` under ``building``: for builders run once per plan, in a worker thread."""
    with building():
        return fn(*args)


_one_builder: RunVar[CapacityLimiter] = RunVar("refitflow_builder")


async def off_loop(fn: Callable[..., T], *args: Any) -> T:
    """``built(fn, *args)`` in a worker thread, one such builder at a time per event loop.

    For work that mostly holds the GIL (plan builders, read lists, verify's views and small hashes): two
    such threads side by side go no faster than one after the other, but each is one more thread the
    event loop's thread can lose the GIL to at every switch — the first refit of 10,000 tensors had its
    loop's ticks late by 5.5–7.6 ms at the 99th percentile with them side by side, 2.6–5.0 ms one at a
    time (``bench/loop_lag.py``). Work that lets the GIL go (copies, NIXL posts) keeps its own threads.
    """
    try:
        limiter = _one_builder.get()
    except LookupError:
        limiter = CapacityLimiter(1)
        _one_builder.set(limiter)
    return await anyio.to_thread.run_sync(built, fn, *args, limiter=limiter)


_BREATH_S = 0.001
_calls = [0]  # breathe() calls (shared by threads: approximate is enough)
_last = [0.0]  # when the GIL was last let go


def breathe() -> None:
    """Called often from long CPU-bound loops in worker threads (plan building): every 64th call, ``let_go``."""
    _calls[0] += 1
    if not _calls[0] & 63:
        let_go()


def let_go() -> None:
    """About every millisecond, release the GIL for a moment so the event loop's thread gets it now, not
    at the interpreter's 5 ms switch interval (or never, inside one long C call that keeps it). A no-op on
    the main thread (nothing runs beside it there)."""
    now = time.perf_counter()
    if now - _last[0] > _BREATH_S and threading.current_thread() is not threading.main_thread():
        time.sleep(0)
        _last[0] = time.perf_counter()


def waker() -> Callable[[Callable[[], object]], object]:
    """For the running event loop (asyncio or trio): a function any thread may call to have a callback run soon on
    the loop's thread. It returns at once (unlike ``anyio.from_thread.run_sync``, which waits for the loop): a
    thread posting transfers tells the loop each one's end and goes on."""
    try:
        return asyncio.get_running_loop().call_soon_threadsafe  # asked for every read submitted: no sniffio first
    except RuntimeError:  # no asyncio loop runs in this thread
        pass
    if sniffio.current_async_library() == "trio":
        import trio

        token = trio.lowlevel.current_trio_token()
        return lambda fn: token.run_sync_soon(fn)
    raise RuntimeError(f"no event loop refitflow knows runs in this thread ({sniffio.current_async_library()})")
