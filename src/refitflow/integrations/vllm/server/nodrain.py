"""No-drain updates: vLLM's engine core keeps stepping while its workers prepare a version, and swaps it in
between two steps.

The driver's sequence is vLLM's own — ``start_weight_update`` → ``update_weights`` → ``finish_weight_update``
— with ``"no_drain": true`` in the update info (shadow mode), and no pause:

- ``update_weights``: each worker starts pulling, verifying and voting in the background (refitflow's loop
  thread; ``RankSession.begin_update``) and answers at once. The engine core answers the driver only when
  every worker prepared the version and the engine voted COMMIT — a utility call that answers later
  (a ``Future``), so the core goes on scheduling and stepping meanwhile — or with the failure (HTTP 500,
  as on the paused path: the previous version serves on, a next update may start at once);
- ``finish_weight_update``: answered once the version is live. At the first step boundary after it (and
  after every worker prepared), the core calls every worker's ``finish_weight_update`` — the shadow
  becomes live on the worker's own thread, between two forwards — applies the update's KV-cache policy,
  and sets vLLM's weight-version label in the same moment: every token after it is labelled with the new
  version, every token before it with the old one (vLLM attaches the label per step).

A LoRA adapter's ``update_weights`` (``"adapter"`` in the update info, ``lora.py``) takes the same path without
vLLM's session: each worker lands the version in the background, the core answers once every worker did
(or with the first failure), and there is no swap: the driver then names it to vLLM.

While an update is in flight the core polls its workers every ``POLL_S`` between steps (idle, it does not
block on its input queue, so the swap happens without a request to step). KV policies (``kv``): ``keep``
(in-flight requests go on with their KV cache, computed by the old weights: the async-RL default),
``reset_prefix`` (no new request reuses a prefix cached under the old weights; requests in flight keep
theirs — vLLM resets the prefix cache only once no running request holds blocks, so the reset is retried
at each step until it succeeds), ``recompute`` (every request in flight is preempted and recomputes its KV
with the new weights; the prefix cache is reset).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from refitflow.integrations.vllm.server.workers import call, worker_state

__all__ = ["POLL_S", "Drain", "active", "begin", "finish", "has_work", "tick", "wanted"]

log = logging.getLogger(__name__)

POLL_S = 0.005  # how often the core asks its workers while an update is in flight (between two steps)
IDLE_S = 0.001  # an idle core, instead of blocking on its input queue, sleeps this long between polls
_ATTR = "_refitflow_drain"


@dataclass(eq=False)
class Drain:
    """One no-drain update, on the engine core."""

    label: str | None  # the weight-version label from the swap on (None: the committed version)
    kv: str
    prepared: Future[Any] = field(default_factory=Future)  # the driver's update_weights
    finished: Future[Any] | None = None  # the driver's finish_weight_update
    next_poll: float = 0.0
    reset_pending: bool = False  # kv="reset_prefix": a reset vLLM refused (blocks in use), retried each step
    adapter: bool = False  # a LoRA adapter landing on every worker (``lora.py``): answered once landed, no swap


def _info(kwargs: Any) -> dict[str, Any]:
    info = (kwargs or {}).get("update_info")
    if isinstance(info, list):  # one per worker (vLLM's list form): they agree on these fields
        info = info[0] if info else {}
    return info if isinstance(info, dict) else {}


def wanted(method: Any, kwargs: Any) -> bool:
    """Whether this call is a no-drain ``update_weights`` (or an adapter's, which never drains either)."""
    info = _info(kwargs)
    return method == "update_weights" and bool(info.get("no_drain") or info.get("adapter"))


def active(core: Any) -> Drain | None:
    return getattr(core, _ATTR, None)


def begin(core: Any, timeout: Any, args: tuple, kwargs: Any) -> Future[Any]:
    """Start a no-drain update on every worker; the future the driver's ``update_weights`` waits on."""
    if active(core) is not None:
        raise RuntimeError("refitflow: a no-drain update is already in flight: finish it first")
    info = _info(kwargs)
    adapter = bool(info.get("adapter"))
    # each worker begins in the background and answers at once
    call(core, "engine.begin_adapter" if adapter else "update_weights", timeout, args, kwargs)
    drain = Drain(label=info.get("weight_version"), kv=str(info.get("kv", "keep")), adapter=adapter)
    setattr(core, _ATTR, drain)
    return drain.prepared


def finish(core: Any) -> Future[Any]:
    """The driver's ``finish_weight_update`` during a no-drain update: answered once the version is live."""
    drain = active(core)
    assert drain is not None
    if drain.finished is None:
        drain.finished = Future()
    return drain.finished


def tick(core: Any, idle: bool, settled: Callable[[Any], None]) -> None:
    """Between two steps (``post_step``): poll the workers when due; swap once prepared and finished;
    ``settled(core)`` once an update ended either way (the serving gate reads the workers' fences)."""
    if getattr(core, "_refitflow_reset_prefix", False) and core.reset_prefix_cache():
        core._refitflow_reset_prefix = False
    drain = active(core)
    if drain is None:
        return
    now = time.monotonic()
    if now < drain.next_poll:
        if idle:
            time.sleep(IDLE_S)
        return
    drain.next_poll = now + POLL_S
    try:
        poll = functools.partial(worker_state, adapter=drain.adapter)
        states = [s or {} for s in core.model_executor.collective_rpc(poll, 30.0)]
    except Exception as exc:
        _fail(core, drain, f"the workers' update state could not be read: {type(exc).__name__}: {exc}")
        return
    failed = [s["error"] for s in states if s.get("phase") == "failed"]
    if failed:
        _fail(core, drain, f"Worker failed with error '{failed[0]}', please check the stack trace above")
        settled(core)
        return
    if not all(s.get("phase") == "prepared" for s in states):
        return
    if drain.adapter:  # landed on every worker: the driver may name it to vLLM now
        setattr(core, _ATTR, None)
        log.info("refitflow: adapter version %s landed on every worker", states[0].get("version"))
        drain.prepared.set_result([None] * len(states))
        return
    if not drain.prepared.done():
        drain.prepared.set_result([None] * len(states))
    if drain.finished is not None:
        _swap(core, drain, states)
        settled(core)


def _fail(core: Any, drain: Drain, message: str) -> None:
    """The update failed: the driver's calls answer the failure, and vLLM's update session is closed on every
    worker (as vLLM closes it when ``update_weights`` raises), so the next update can start at once."""
    setattr(core, _ATTR, None)
    try:
        if not drain.adapter:  # an adapter update opened no session
            call(core, "finish_weight_update", 60.0)  # nothing prepared: it only closes vLLM's session
    except Exception as exc:
        log.warning("refitflow: closing vLLM's update session after the failure: %s", exc)
    error = RuntimeError(message)
    for future in (drain.prepared, drain.finished):
        if future is not None and not future.done():
            future.set_exception(error)
    what = "adapter update failed (nothing was named to vLLM)" if drain.adapter else "no-drain update failed"
    log.error("refitflow: the %s; the previous version serves on: %s", what, message)


def _swap(core: Any, drain: Drain, states: list[dict[str, Any]]) -> None:
    setattr(core, _ATTR, None)
    assert drain.finished is not None
    t0 = time.perf_counter()
    try:
        results = call(core, "finish_weight_update", 60.0)  # on every worker, between two forwards
    except Exception as exc:
        drain.finished.set_exception(exc)
        return
    seconds = time.perf_counter() - t0
    version = states[0].get("version")
    core.set_weight_version(drain.label if drain.label is not None else str(version))
    if drain.kv == "recompute":
        core.reset_prefix_cache(reset_running_requests=True)
    elif drain.kv == "reset_prefix" and not core.reset_prefix_cache():
        core._refitflow_reset_prefix = True  # blocks still in use: again at every step until it resets
    log.info("refitflow: version %s swapped in between two steps (%.3f ms on the workers, kv=%s)", version,
             seconds * 1e3, drain.kv)  # fmt: skip
    drain.finished.set_result(results)


def has_work(core: Any) -> bool:
    """Keep the core's loop turning (not blocked on its input queue) while an update is in flight."""
    return active(core) is not None or bool(getattr(core, "_refitflow_reset_prefix", False))
