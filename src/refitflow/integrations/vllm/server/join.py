"""A vLLM server that joins a running fleet: it catches up before it takes a request, and says when it is ready.

Started with ``REFITFLOW_JOIN`` (the bodies of vLLM's own routes, as JSON: ``{"init_info": {...},
"update_info": {...}}``; ``update_info`` optional) and ``VLLM_PLUGINS`` naming ``refitflow`` (vLLM loads an
endpoint plugin only when named), the server's API process, before it listens:

1. refuses every generation request (HTTP 503, "this server does not serve yet: catching up ...") — it holds
   the weights it loaded from disk, not the fleet's;
2. runs vLLM's own update sequence on itself: ``init_weight_transfer_engine`` with ``init_info``, then
   ``start_weight_update`` → ``update_weights`` → ``finish_weight_update``, labelled with the version
   committed. The update (``catch_up_s``, 10 s) refits the version its peers relay
   (``receiver_options: {"serve_replicas": true}`` on every server; the registry's ``relayed``), waiting up
   to ``catch_up_s`` for them to relay the newest one held (a fleet about to refit it); when no peer relays
   anything, the newest version (``version``, 0: any), waited for. Its workers read it from those peers, the
   trainer only for what no peer offers;
3. once that commits it still refuses requests — its readiness route (``GET /refitflow/ready``,
   ``endpoints``) says ``catching_up``, with ``caught_up`` the version it holds — until its fleet's driver
   takes it in: ``VllmFleet.add`` refits it to the fleet's version (nothing to read when the fleet has not
   moved on since) and from that commit on it serves. So it never serves a version its fleet has left
   behind while outside the driver's refits. A failed attempt (no version yet, a peer gone, a bad byte) is
   retried after 1, 2, 4 … 30 s.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any

from refitflow.core.errors import ConfigError
from refitflow.engine.readiness import EngineState, gated, rank_summary
from refitflow.integrations.hosting.http import set_ready
from refitflow.integrations.hosting.info import RefitflowInitInfo, RefitflowUpdateInfo
from refitflow.integrations.hosting.keys import JOIN_ENV, join_setting
from refitflow.integrations.vllm.server import gate

__all__ = ["ENV", "JoinSpec", "catch_up", "caught_up", "install", "joining", "judge", "readiness", "spec_from_env",
           "start", "taken_in"]  # fmt: skip

log = logging.getLogger(__name__)

ENV = JOIN_ENV
_JOINING = "_refitflow_joining"  # on AsyncLLM: why it does not serve yet (catching up), or None once current
_TASK = "_refitflow_join_task"
_CAUGHT_UP = "_refitflow_caught_up"  # on AsyncLLM: the version its own catch-up committed (the driver's turn now)
_NO_PLUGIN = (f"{ENV} is set but refitflow's endpoint plugin did not start the catch-up: start the server with "
              "VLLM_PLUGINS naming refitflow (vLLM loads endpoint plugins only when named)")  # fmt: skip
RETRY_S = (1.0, 30.0)  # first and longest wait between two attempts
CATCH_UP_S = 10.0  # how long a joiner waits for its peers to relay the newest version before reading it alone


class JoinSpec:
    """``REFITFLOW_JOIN``, checked: the init info and the catch-up's update info (``version`` 0: the newest)."""

    def __init__(self, init_info: dict[str, Any], update_info: dict[str, Any] | None = None) -> None:
        self.init = RefitflowInitInfo(**init_info).to_dict()
        update = {"version": 0, "catch_up_s": CATCH_UP_S, **(update_info or {})}
        parsed = RefitflowUpdateInfo(**update)
        if parsed.no_drain or parsed.adapter or parsed.catch_up_s is None:
            raise ConfigError("a catch-up is a plain update that follows its peers: no no_drain, no adapter, and "
                              "catch_up_s a number of seconds")  # fmt: skip
        self.update = update


def spec_from_env() -> JoinSpec | None:
    """The server's ``REFITFLOW_JOIN``, or None; a ``ConfigError`` naming what is wrong with it."""
    raw = join_setting()
    if raw is None:
        return None
    try:
        body = json.loads(raw)
        return JoinSpec(body["init_info"], body.get("update_info"))
    except ConfigError:
        raise
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{ENV} must be JSON {{\"init_info\": {{...}}, \"update_info\": {{...}}}} (the bodies of "
                          f"vLLM's routes): {type(exc).__name__}: {exc}") from exc  # fmt: skip


def joining(llm: Any) -> str | None:
    """Why ``llm``'s server does not serve yet (catching up), or None."""
    if _JOINING in vars(llm):
        return vars(llm)[_JOINING]
    return _NO_PLUGIN if join_setting() is not None else None


def caught_up(llm: Any) -> int | None:
    """The version this server's own catch-up committed while it waits for its fleet's driver, or None."""
    return getattr(llm, _CAUGHT_UP, None) if joining(llm) else None


def taken_in(llm: Any) -> None:
    """A weight update committed after the catch-up — the fleet's driver's (``gate``, on every
    ``finish_weight_update`` that succeeded): the server is one of the fleet now, and serves."""
    if _CAUGHT_UP in vars(llm) and vars(llm).get(_JOINING):
        setattr(llm, _JOINING, None)
        log.info("refitflow: taken in by the fleet's driver; serving")


def start(llm: Any, spec: JoinSpec) -> None:
    """Refuse requests and start catching up (once per server)."""
    if _TASK in vars(llm):
        return
    setattr(llm, _JOINING, "catching up: starting")
    setattr(llm, _TASK, asyncio.get_running_loop().create_task(catch_up(llm, spec), name="refitflow-join"))


async def catch_up(llm: Any, spec: JoinSpec) -> int:
    """vLLM's update sequence on this server until a version commits; that version."""
    from refitflow.integrations.vllm.weight_transfer import WeightTransferInitRequest, WeightTransferUpdateRequest

    wait, attempt, opened = RETRY_S[0], 0, False
    while True:
        attempt += 1
        step = "init_weight_transfer_engine"
        try:
            if not opened:
                setattr(llm, _JOINING, "catching up: opening refitflow on every worker")
                await llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=spec.init))
                opened = True
            setattr(llm, _JOINING, "catching up: pulling the version its peers hold")
            step = "start_weight_update"
            await llm.start_weight_update()
            step = "update_weights"
            await llm.update_weights(WeightTransferUpdateRequest(update_info=spec.update))
            step = "finish_weight_update"
            await llm.finish_weight_update()
            state = await gate.refresh(llm, workers=True)
            version = _committed(state)
            if version is not None:
                await llm.update_weight_version(str(version))
            setattr(llm, _JOINING, f"caught up with version {version}: waiting for its fleet's driver to take it "
                                   "in (VllmFleet.add refits it to the fleet's version)")  # fmt: skip
            setattr(llm, _CAUGHT_UP, version)
            judge(llm, state)  # the workers' state as just read (setting the label is no weight call)
            log.info("refitflow: caught up with version %s (attempt %d); serving once the fleet's driver takes it in",
                     version, attempt)  # fmt: skip
            return version if version is not None else -1
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            why = f"{type(exc).__name__}: {exc}"[:400]
            setattr(llm, _JOINING, f"catching up: attempt {attempt} failed at {step} ({why}); next in {wait:.0f} s")
            log.warning("refitflow: catch-up attempt %d failed at %s: %s", attempt, step, why)
            if step == "init_weight_transfer_engine":  # some workers may have opened: start over on all
                with contextlib.suppress(Exception):
                    await llm.shutdown_weight_transfer_engine()
            elif step == "update_weights":  # a worker in doubt keeps its peers' update open: close it
                with contextlib.suppress(Exception):
                    await llm.finish_weight_update()
            await asyncio.sleep(wait)
            wait = min(wait * 2, RETRY_S[1])


def _committed(state: dict[str, Any]) -> int | None:
    versions = {w.get("committed_version") for w in state.get("workers") or () if isinstance(w, dict)}
    return versions.pop() if len(versions) == 1 else None


async def readiness(llm: Any) -> tuple[EngineState, list[Any]]:
    """This server as a router sees it (``rf.EngineState``), and each worker's gate status: as read after the
    last weight-transfer call (a worker's fence changes only in one), so a poll never waits for an update
    that is running; the workers are asked only before the first such call."""
    state = gate.cached(llm) or await gate.refresh(llm, workers=True)
    return judge(llm, state), list(state.get("workers") or [])


def judge(llm: Any, state: dict[str, Any]) -> EngineState:
    """The server's ``rf.EngineState`` from its engine core's gate (``gate.refresh``); sets the metric."""
    workers = state.get("workers") or []
    name = "this server"
    verdict = gated(name, _committed(state), fenced=state.get("reason"), joining=joining(llm), behind=gate.behind(llm))
    if verdict is None and not workers:
        verdict = EngineState(engine=name, state="gone", version=None, reason="its workers did not answer")
    elif verdict is None:
        verdict = rank_summary(name, [w if isinstance(w, dict) else None for w in workers])
    set_ready(verdict.ready)
    return verdict


def _after_call(llm: Any, method: str, failed: Exception | None, state: dict[str, Any]) -> None:
    if method == "finish_weight_update" and failed is None:
        taken_in(llm)
    judge(llm, state)


def _refusal(llm: Any) -> str | None:
    waiting = joining(llm)
    return None if waiting is None else f"this server does not serve yet: {waiting}"


def install() -> None:
    """Add the join's hooks to the API server's gate (idempotent; ``plugin.register`` runs it): a
    ``REFITFLOW_JOIN`` server refuses requests until taken in, and every weight-transfer call updates its
    readiness (and the gauge)."""
    if _after_call not in gate.AFTER_CALL:
        gate.AFTER_CALL.append(_after_call)
        gate.REFUSALS.append(_refusal)
