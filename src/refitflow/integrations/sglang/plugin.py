"""The ``sglang.srt.plugins`` entry point: SGLang loads it in every scheduler process before serving.

``register`` puts an AROUND hook (SGLang's ``HookRegistry``) on the model runner's
``WeightUpdater.update_weights_from_tensor``. For refitflow's ``load_format`` (``payload.LOADER``) it
runs the update under the loader's guard and turns any exception into SGLang's ``(False, message)``
answer — SGLang itself would let it stop the scheduler, taking the server down — so a failed refit
reaches the caller as ``{"success": false, "message": ...}``. Other load formats pass through untouched.
It also registers the serving gate's hooks (``gate.HOOKS``): a server left not serving by an update
(a rank fenced, in doubt, or on another version) runs no batch and answers no request until a version
commits on every rank. In the HTTP server's process it adds the readiness route (``ready``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from refitflow.integrations.sglang import gate, loader, ready
from refitflow.integrations.sglang.payload import LOADER

__all__ = ["TARGET", "guard", "register"]

log = logging.getLogger(__name__)

TARGET = "sglang.srt.model_executor.model_runner_components.weight_updater.WeightUpdater.update_weights_from_tensor"
_registered = False


def register() -> None:
    """Register the guard with SGLang's hook registry (SGLang applies it after loading every plugin)."""
    global _registered
    if _registered:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, guard, HookType.AROUND)
    for target, hook in gate.HOOKS.items():
        HookRegistry.register(target, hook, HookType.AROUND)
    ready.attach()
    _registered = True


def guard(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run SGLang's update; for refitflow's load format, a failure is ``(False, message)``, never a raise."""
    if kwargs.get("load_format", args[2] if len(args) > 2 else None) != LOADER:
        return original(*args, **kwargs)
    with loader.guarded():
        try:
            return original(*args, **kwargs)
        except Exception as exc:
            message = f"refitflow: {type(exc).__name__}: {exc}"
            notes = getattr(exc, "__notes__", None)
            if notes:
                message += " (" + "; ".join(notes) + ")"
            log.error("%s", message)
            return False, message
