"""vLLM's weight-transfer interface through one stable path, whichever layout the installed vLLM has.

vLLM 0.32 and 0.33 keep it in ``vllm/distributed/weight_transfer/``; vLLM's newest code moves it to
``vllm/backends/distributed/weight_transfer/`` and leaves at the old path only a package whose ``__getattr__``
forwards the names the package exports — ``from vllm.distributed.weight_transfer.base import ...`` no longer
finds its module there. Every part of refitflow imports vLLM's weight-transfer classes from here: the new layout
when the installed vLLM has it, else the old one (``ROOT`` says which). A module of the new layout that exists but
fails to import raises as it is (only a missing layout falls back).
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import TYPE_CHECKING

__all__ = [
    "NEW_ROOT",
    "OLD_ROOT",
    "ROOT",
    "HTTPVLLMWeightSyncClient",
    "ModuleSource",
    "Shard",
    "TrainerInitInfo",
    "TrainerWeightTransferEngine",
    "VLLMWeightSyncClient",
    "WeightSource",
    "WeightTransferEngine",
    "WeightTransferEngineFactory",
    "WeightTransferInitRequest",
    "WeightTransferTrainerFactory",
    "WeightTransferUpdateRequest",
    "submodule",
]

NEW_ROOT = "vllm.backends.distributed.weight_transfer"
OLD_ROOT = "vllm.distributed.weight_transfer"


def _root() -> str:
    try:
        importlib.import_module(NEW_ROOT)
    except ModuleNotFoundError as exc:
        if exc.name is None or not NEW_ROOT.startswith(exc.name):
            raise  # the new layout is there and one of its own imports failed: say so
        importlib.import_module(OLD_ROOT)
        return OLD_ROOT
    return NEW_ROOT


ROOT = _root()


def submodule(name: str) -> ModuleType:
    """vLLM's ``weight_transfer.<name>`` (``base``, ``factory``, ``clients``, ...) in the installed layout."""
    return importlib.import_module(f"{ROOT}.{name}")


if TYPE_CHECKING:  # the classes as vLLM 0.33 (the layout the type checker sees) defines them
    from vllm.distributed.weight_transfer.base import (
        ModuleSource,
        Shard,
        TrainerInitInfo,
        TrainerWeightTransferEngine,
        VLLMWeightSyncClient,
        WeightSource,
        WeightTransferEngine,
        WeightTransferInitRequest,
        WeightTransferUpdateRequest,
    )
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory
else:
    _WHERE = {"HTTPVLLMWeightSyncClient": "clients", "WeightTransferEngineFactory": "factory",
              "WeightTransferTrainerFactory": "factory"}  # fmt: skip

    def __getattr__(name: str) -> object:  # looked up on first use: vLLM 0.32 lacks the trainer side's names
        if name not in __all__ or name.isupper() or name == "submodule":
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        return getattr(submodule(_WHERE.get(name, "base")), name)
