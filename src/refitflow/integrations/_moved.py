"""Old module paths of the integrations, kept importable (with a ``DeprecationWarning``) after they moved by role.

``import refitflow.integrations.vllm.info`` still works and gives the module now at
``refitflow.integrations.hosting.info``; installed entry points of an older refitflow
(``refitflow.integrations.vllm.plugin:register``) keep loading until the package is reinstalled.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

__all__ = ["MOVED", "install"]

_P = "refitflow.integrations."
MOVED = {  # old module -> where it lives now
    **{
        _P + m: _P + "hosting." + m
        for m in ("rank_session", "load_weights", "writers", "loop_thread", "fleet", "http", "vote_setup",
                  "fused_model", "keys")
    },
    _P + "vllm.info": _P + "hosting.info",
    **{_P + "vllm." + m: _P + "vllm.worker." + m for m in ("place", "kernels", "reload", "reprocessing", "mla")},
    _P + "vllm.lora": _P + "vllm.worker.lora",
    _P + "vllm.engine": _P + "vllm.worker.backend",
    **{_P + "vllm." + m: _P + "vllm.server." + m for m in ("plugin", "endpoints", "gate", "nodrain", "join")},
    _P + "vllm._workers": _P + "vllm.server.workers",
    _P + "vllm.versions": _P + "vllm.driver.versions",
    _P + "vllm.checksums": _P + "vllm.driver.checksums",
}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old path and hands out the module under its new one (``sys.modules`` then holds both)."""

    def __init__(self) -> None:
        self._specs: dict[str, importlib.machinery.ModuleSpec | None] = {}

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        new = MOVED[spec.name]
        warnings.warn(f"{spec.name} moved to {new}; import it from there", DeprecationWarning, stacklevel=2)
        module = importlib.import_module(new)
        self._specs[spec.name] = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the module ran under its new name. Its own spec back (the import set the alias's)."""
        alias = module.__spec__.name if module.__spec__ is not None else ""
        if alias in self._specs:
            module.__spec__ = self._specs.pop(alias)


def install() -> None:
    """Put the alias finder on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, _Alias) for f in sys.meta_path):
        sys.meta_path.append(_Alias())
