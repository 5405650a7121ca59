"""Calls from vLLM's engine core to its workers, for the serving gate and no-drain updates.

``call(core, method, ...)`` runs a weight-transfer hook on every worker through ``answering``, which returns a
worker's failure as a value: vLLM 0.32's ``MultiprocExecutor.collective_rpc`` raises at the first worker that
failed and leaves the other workers' answers in their queues, so with TP > 1 every later call read the
previous call's answers (found on a real TP 2 server). Every answer is read; the first failure is raised as
vLLM's executor raises it. ``worker_fence`` and ``worker_state`` run on each worker too.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

__all__ = ["Failed", "answering", "call", "worker_fence", "worker_state"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Failed:
    """A worker's hook raised: its message (``answering``)."""

    message: str


def answering(method: str, worker: Any, *args: Any, **kwargs: Any) -> Any:
    """Run on each worker: its weight-transfer hook (``engine.<name>``: a method of refitflow's engine), a failure
    answered as a value."""
    try:
        owner = worker
        if method.startswith("engine."):
            owner, method = worker.weight_transfer_engine, method.removeprefix("engine.")
        return getattr(owner, method)(*args, **kwargs)
    except Exception as exc:
        log.exception("refitflow: %s failed on this worker", method)
        return Failed(str(exc))


def call(core: Any, method: str, timeout: Any = None, args: tuple = (), kwargs: Any = None) -> list[Any]:
    """``method`` on every worker of ``core``'s executor; the answers, or the first failure raised."""
    results = core.model_executor.collective_rpc(functools.partial(answering, method), timeout, args, kwargs)
    for result in results:
        if isinstance(result, Failed):
            raise RuntimeError(f"Worker failed with error '{result.message}', please check the stack trace above "
                               "for the root cause")  # fmt: skip
    return list(results)


def _engine_call(worker: Any, name: str) -> Any:
    engine = getattr(worker, "weight_transfer_engine", None)
    fn = getattr(engine, name, None)
    return fn() if callable(fn) else None


def worker_fence(worker: Any) -> dict[str, Any] | None:
    """Run on each worker: its refitflow fence, or None without a refitflow engine."""
    return _engine_call(worker, "gate_status")


def worker_state(worker: Any, adapter: bool = False) -> dict[str, Any] | None:
    """Run on each worker: its no-drain update's (or adapter update's) progress, or None without a refitflow
    engine."""
    return _engine_call(worker, "adapter_state" if adapter else "drain_state")
