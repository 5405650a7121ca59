"""The serving gate in SGLang: a server whose update left a rank fenced, in doubt or on another version than
its peers runs no model and answers no request until a version commits on every rank.

The loader's answer says when the server must not serve (``answers.NOT_SERVING``: every rank's outcome,
exchanged at the end of each update). The plugin (``plugin.register``) puts these AROUND hooks on SGLang's
own methods, in the processes that have them:

- **scheduler** (every TP rank): after ``SchedulerWeightUpdaterManager.update_weights_from_tensor`` with
  refitflow's load format, a not-serving answer pauses the scheduler (``_engine_paused``: no batch runs)
  and aborts its requests with the reason; ``Scheduler.continue_generation`` keeps it paused while so;
- **tokenizer manager** (the HTTP server): after ``update_weights_from_tensor`` it records the answer;
  while it says not serving, ``generate_request`` refuses each request (``ValueError``: SGLang's routes
  answer it with HTTP 400 and the message) and ``continue_generation`` refuses to resume, whatever the
  driver does. A later update that commits on every rank opens both again.

A server started with ``REFITFLOW_JOIN=1`` (joining a running fleet) refuses every request the same way —
"catching up" — until its first refitflow update committed (``SglangFleet.add`` refits it to the fleet's
version); a server whose last update failed and that kept its previous version is *behind* (it serves;
its readiness route says so: ``ready``).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from refitflow.integrations.hosting.keys import join_setting
from refitflow.integrations.sglang.answers import NOT_SERVING
from refitflow.integrations.sglang.payload import LOADER

__all__ = ["HOOKS", "behind", "closed", "joining"]

log = logging.getLogger(__name__)

_STATE = "_refitflow_not_serving"  # on the scheduler / tokenizer manager: why it must not serve, or None
_JOINED = "_refitflow_joined"  # on the tokenizer manager: a refitflow update committed here
_BEHIND = "_refitflow_behind"  # on the tokenizer manager: why its last update failed (it serves the one before)
_SCHED = "sglang.srt.managers.scheduler_components.weight_updater.SchedulerWeightUpdaterManager"
_TOK = "sglang.srt.managers.tokenizer_manager.TokenizerManager"


def closed(owner: Any) -> str | None:
    """Why ``owner`` (a scheduler or tokenizer manager) must not serve now, or None."""
    return getattr(owner, _STATE, None)


def joining(manager: Any) -> str | None:
    """Why a server started to join a fleet does not serve yet (no refitflow version committed), or None."""
    if join_setting() is None or getattr(manager, _JOINED, False):
        return None
    return ("catching up: this server joined a running fleet and serves once a version committed on it (the "
            "fleet's driver refits it: SglangFleet.add)")  # fmt: skip


def behind(manager: Any) -> str | None:
    """Why the server's last update failed while it kept serving the version before, or None."""
    return getattr(manager, _BEHIND, None)


def _verdict(success: bool, message: str) -> str | None:
    if success or NOT_SERVING not in message:
        return None
    return message[message.index(NOT_SERVING) :].split(";")[0].rstrip(")")


def updated_scheduler(original: Callable[..., Any], manager: Any, recv_req: Any) -> Any:
    out = original(manager, recv_req)
    if getattr(recv_req, "load_format", None) != LOADER:
        return out
    scheduler: Any = manager.scheduler
    reason = _verdict(bool(out.success), str(out.message))
    setattr(scheduler, _STATE, reason)
    if reason is not None:
        log.error("refitflow: %s; the scheduler pauses and aborts its requests until a version commits", reason)
        scheduler._engine_paused = True
        abort = getattr(scheduler, "abort_request", None)
        if callable(abort):
            from sglang.srt.managers.io_struct import AbortReq

            abort(AbortReq(abort_all=True, abort_message=reason))
    return out


def continued_scheduler(original: Callable[..., Any], scheduler: Any, recv_req: Any) -> Any:
    reason = closed(scheduler)
    if reason is not None:
        log.error("refitflow: continue_generation refused: %s", reason)
        return None
    return original(scheduler, recv_req)


async def updated_tokenizer(original: Callable[..., Any], manager: Any, obj: Any, *args: Any, **kwargs: Any) -> Any:
    success, message = await original(manager, obj, *args, **kwargs)
    if getattr(obj, "load_format", None) == LOADER:
        reason = _verdict(bool(success), str(message))
        setattr(manager, _STATE, reason)
        setattr(manager, _BEHIND, None if success else f"its update failed: {message}"[:500])
        if success:
            setattr(manager, _JOINED, True)
        if reason is not None:
            manager.abort_request(abort_all=True)
    return success, message


async def generate(original: Callable[..., Any], manager: Any, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
    _refuse(manager, "this request")
    async for out in original(manager, *args, **kwargs):
        yield out


async def continued_tokenizer(original: Callable[..., Any], manager: Any, *args: Any, **kwargs: Any) -> Any:
    _refuse(manager, "continue_generation")
    return await original(manager, *args, **kwargs)


def _refuse(manager: Any, what: str) -> None:
    reason = closed(manager) or joining(manager)
    if reason is not None:
        raise ValueError(f"{reason}; {what} is refused until a later version commits on every rank")


HOOKS: dict[str, Callable[..., Any]] = {
    f"{_SCHED}.update_weights_from_tensor": updated_scheduler,
    "sglang.srt.managers.scheduler.Scheduler.continue_generation": continued_scheduler,
    "sglang.srt.managers.tokenizer_control_mixin.TokenizerControlMixin.update_weights_from_tensor": updated_tokenizer,
    f"{_TOK}.generate_request": generate,
    f"{_TOK}.continue_generation": continued_tokenizer,
}
