"""The serving gate: a vLLM server none of whose workers is fenced runs the model; otherwise nothing does.

A worker is *fenced* when a version failed after it began writing the live weights in place (or after a
commit, while reprocessing): its model is a mix of two versions. vLLM itself would go on serving it —
its ``/resume`` reopens scheduling whatever the weights hold — so the gate lives in vLLM's own processes,
installed by the plugin hook (``plugin.register``), on servers whose weight-transfer backend is
``refitflow``:

- **engine core** (where every step is scheduled): each weight-transfer hook runs on the workers through
  ``_workers.call`` (every worker's answer read, even after a failure); a no-drain update
  (``nodrain``) is answered later while the core goes on stepping. After each weight-transfer call that
  reaches the workers (``init``/``start``/``update``/``finish``/``shutdown``, by any client: the HTTP
  routes, Ray, an in-process ``AsyncLLM``), it asks every worker for its fence before the next step. When
  one is fenced it pauses scheduling with vLLM's own ``pause_scheduler(mode="abort")`` — in-flight requests
  end, new ones wait — and refuses ``resume_scheduler`` with the reason; once every worker is ready again (a later
  version committed) it resumes what it paused. The worker's forward is never called on a mixed model.
- **API server** (``AsyncLLM``): after the same calls it reads the engine core's state (the utility
  ``refitflow_gate`` the gate adds), and refuses each request while a
  worker is fenced with ``RetryableRequestError`` (HTTP 503) naming the reason; a request in flight when
  the fence closed ends with that error too, not with a partial answer.

A vLLM that lacks these hooks (another version) logs that the gate is off.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from refitflow.integrations.vllm.server import nodrain
from refitflow.integrations.vllm.server.workers import call, worker_fence

__all__ = ["AFTER_CALL", "REFUSALS", "WEIGHT_METHODS", "behind", "cached", "install", "refresh"]

log = logging.getLogger(__name__)

WEIGHT_METHODS = frozenset({
    "init_weight_transfer_engine", "start_weight_update", "update_weights", "finish_weight_update",
    "shutdown_weight_transfer_engine",
})  # fmt: skip
_STATE = "_refitflow_fenced"  # on the engine core / AsyncLLM: the reason, or None
_WORKERS = "_refitflow_workers"  # on the engine core / AsyncLLM: each worker's last gate status
_BEHIND = "_refitflow_behind"  # on AsyncLLM: why the last update failed (the version before serves), or None
_PAUSED = "_refitflow_paused"  # on the engine core: the gate paused scheduling (and resumes it)
_MARK = "_refitflow_gate"
# what else the API server's gate runs (``join`` adds its own): after every weight-transfer call, with the
# engine core's state (``refresh``), and before every request (a reason to refuse it, or None)
AFTER_CALL: list[Callable[[Any, str, Exception | None, dict[str, Any]], None]] = []
REFUSALS: list[Callable[[Any], str | None]] = []
_RPC_TIMEOUT_S = 30.0


def _ours(owner: Any) -> bool:
    config = getattr(getattr(owner, "vllm_config", None), "weight_transfer_config", None)
    return getattr(config, "backend", None) == "refitflow"


def _reason(states: list[Any]) -> str | None:
    """Why the server must not serve (None: it may): the first fenced worker's reason."""
    for rank, state in enumerate(states):
        if isinstance(state, dict) and state.get("fence") == "fenced":
            return f"worker {rank} is fenced: {state.get('reason') or 'a version failed part-way'}"
    return None


def install() -> None:
    """Patch vLLM's engine core and ``AsyncLLM`` in this process (idempotent)."""
    try:
        from vllm.v1.engine import core
    except ImportError as exc:
        log.warning("refitflow: vLLM's engine core cannot be imported (%s): the serving gate is off", exc)
        return
    for cls in vars(core).values():
        if isinstance(cls, type) and issubclass(cls, core.EngineCore):
            _patch_core(cls)
    try:
        from vllm.v1.engine.async_llm import AsyncLLM
    except ImportError:  # a worker-only process
        return
    _patch_async_llm(AsyncLLM)


def _patch_core(cls: type) -> None:
    if "resume_scheduler" in vars(cls) and not hasattr(vars(cls)["resume_scheduler"], _MARK):
        resume = vars(cls)["resume_scheduler"]

        def resume_scheduler(self: Any, *args: Any, **kwargs: Any) -> Any:
            reason = getattr(self, _STATE, None)
            if reason:
                raise RuntimeError(f"refitflow refuses to resume serving: {reason}. It serves again once a later "
                                   "version commits on every worker")  # fmt: skip
            return resume(self, *args, **kwargs)

        setattr(resume_scheduler, _MARK, True)
        cls.resume_scheduler = resume_scheduler  # type: ignore[attr-defined]
    if "has_work" in vars(cls) and not hasattr(vars(cls)["has_work"], _MARK):
        has_work = vars(cls)["has_work"]

        def working(self: Any) -> bool:
            return bool(has_work(self)) or nodrain.has_work(self)

        setattr(working, _MARK, True)
        cls.has_work = working  # type: ignore[attr-defined]
    if "post_step" in vars(cls) and not hasattr(vars(cls)["post_step"], _MARK):
        post_step = vars(cls)["post_step"]

        def stepped(self: Any, model_executed: bool) -> None:
            post_step(self, model_executed)
            if nodrain.has_work(self):
                nodrain.tick(self, idle=not model_executed, settled=_refresh_core)

        setattr(stepped, _MARK, True)
        cls.post_step = stepped  # type: ignore[attr-defined]
    if cls.__name__ == "EngineCore" and "refitflow_gate" not in vars(cls):
        cls.refitflow_gate = _gate_utility  # type: ignore[attr-defined]
    if "collective_rpc" in vars(cls) and not hasattr(vars(cls)["collective_rpc"], _MARK):
        rpc = vars(cls)["collective_rpc"]

        def collective_rpc(self: Any, method: Any, timeout: Any = None, args: tuple = (), kwargs: Any = None) -> Any:
            if method not in WEIGHT_METHODS or not _ours(self):
                return rpc(self, method, timeout, args, kwargs)
            try:
                if nodrain.wanted(method, kwargs):
                    return nodrain.begin(self, timeout, args, kwargs)  # answered once prepared: steps go on
                drain = nodrain.active(self)
                if method == "finish_weight_update" and drain is not None and not drain.adapter:
                    return nodrain.finish(self)  # answered once swapped in between two steps
                return call(self, method, timeout, args, kwargs)
            finally:
                _refresh_core(self)

        setattr(collective_rpc, _MARK, True)
        cls.collective_rpc = collective_rpc  # type: ignore[attr-defined]


def _gate_utility(core: Any, ask_workers: bool = False) -> dict[str, Any]:
    """The engine core's ``refitflow_gate`` utility: why it does not serve (None: it does), and each worker's
    last gate status (``ask_workers``: read again first)."""
    if ask_workers and _ours(core):
        _refresh_core(core)
    return {"reason": getattr(core, _STATE, None), "workers": getattr(core, _WORKERS, None)}


def _refresh_core(core: Any) -> None:
    try:
        states = core.model_executor.collective_rpc(worker_fence, _RPC_TIMEOUT_S)
        reason = _reason(states)
        setattr(core, _WORKERS, list(states))
    except Exception as exc:  # a worker that cannot say: do not serve what it may hold
        reason = f"the workers' fence could not be read ({type(exc).__name__}: {exc})"
        setattr(core, _WORKERS, None)
    was = getattr(core, _STATE, None)
    setattr(core, _STATE, reason)
    if reason and not was:
        log.error("refitflow: %s; pausing the scheduler (in-flight requests end) until a version commits", reason)
        if not core.is_scheduler_paused():
            core.pause_scheduler(mode="abort", clear_cache=True)
            setattr(core, _PAUSED, True)
    elif was and not reason:
        log.info("refitflow: every worker serves a committed version again")
        if getattr(core, _PAUSED, False):
            setattr(core, _PAUSED, False)
            core.resume_scheduler()


def _patch_async_llm(cls: type) -> None:
    if hasattr(cls.collective_rpc, _MARK):  # type: ignore[attr-defined]
        return
    rpc, generate = cls.collective_rpc, cls.generate  # type: ignore[attr-defined]

    async def collective_rpc(self: Any, method: Any, timeout: Any = None, args: tuple = (), kwargs: Any = None) -> Any:
        failed: Exception | None = None
        try:
            return await rpc(self, method, timeout, args, kwargs)
        except Exception as exc:
            failed = exc
            raise
        finally:
            if method in WEIGHT_METHODS and _ours(self):
                _behind(self, method, kwargs, failed)
                state = await refresh(self)
                for hook in AFTER_CALL:
                    hook(self, method, failed, state)

    async def gated_generate(self: Any, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        _refuse(self)
        async for output in generate(self, *args, **kwargs):
            if getattr(output, "finished", False):
                _refuse(self)  # ended by the gate's pause: an error, not a partial answer
            yield output

    for fn in (collective_rpc, gated_generate):
        setattr(fn, _MARK, True)
    cls.collective_rpc = collective_rpc  # type: ignore[attr-defined]
    cls.generate = gated_generate  # type: ignore[attr-defined]


def _behind(llm: Any, method: str, kwargs: Any, failed: Exception | None) -> None:
    """An update that failed leaves the version before serving (or fences): the server is behind its fleet
    until a version commits (``finish_weight_update``)."""
    if method == "update_weights" and failed is not None:
        info = (kwargs or {}).get("update_info") or {}
        if not info.get("adapter"):
            setattr(llm, _BEHIND, f"its update to version {info.get('version')} failed: {failed}"[:500])
    elif method == "finish_weight_update" and failed is None:
        setattr(llm, _BEHIND, None)


async def refresh(llm: Any, *, workers: bool = False) -> dict[str, Any]:
    """Read the engine core's gate (``refitflow_gate``) into ``llm`` (``workers``: have it ask the workers
    again first); what it said. A utility call across processes, a plain call in-process."""
    client = llm.engine_core
    try:
        if hasattr(client, "call_utility_async"):
            state: dict[str, Any] = await client.call_utility_async("refitflow_gate", workers)
        else:
            state = client.engine_core.refitflow_gate(workers)
    except Exception as exc:
        state = {"reason": f"the engine core's fence could not be read ({type(exc).__name__}: {exc})", "workers": None}
    setattr(llm, _STATE, state["reason"])
    setattr(llm, _WORKERS, state["workers"])
    return state


def cached(llm: Any) -> dict[str, Any] | None:
    """What ``refresh`` last read into ``llm`` (after every weight-transfer call), or None before the first."""
    workers = getattr(llm, _WORKERS, None)
    return None if workers is None else {"reason": getattr(llm, _STATE, None), "workers": workers}


def behind(llm: Any) -> str | None:
    """Why ``llm``'s server is behind its fleet (its last update failed), or None."""
    return getattr(llm, _BEHIND, None)


def _refuse(llm: Any) -> None:
    reason = getattr(llm, _STATE, None)
    refusal = (f"this server does not serve while {reason}; it serves again once a later version commits"
               if reason else next(filter(None, (check(llm) for check in REFUSALS)), None))  # fmt: skip
    if refusal:
        from vllm.exceptions import RetryableRequestError

        raise RetryableRequestError(f"refitflow: {refusal}")
