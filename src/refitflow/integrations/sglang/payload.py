"""What the driver sends SGLang's ``/update_weights_from_tensor`` for refitflow (no SGLang import).

SGLang hands its custom weight loader only ``(model, named_tensors)``, and unpickles each TP rank's
``serialized_named_tensors`` entry with a restricted unpickler. A tensor pickled with plain ``pickle``
carries its bytes (``torch.storage._load_from_bytes``, which that unpickler allows and loads safely),
so a driver on any host can send one: ``[("refitflow.update", <uint8 tensor of JSON>)]``, the JSON
holding the init info (once per trainer connection, the same on every call) and the update info (the
version). Nothing points at the driver's memory, unlike SGLang's own tensor payloads (shared memory,
CUDA IPC), which only a driver on the same host can send.
"""

from __future__ import annotations

import base64
import pickle
from collections.abc import Iterable
from typing import Any

import orjson
import torch

from refitflow.core.errors import ConfigError
from refitflow.integrations.hosting.info import RefitflowInitInfo, RefitflowUpdateInfo

__all__ = ["KEY", "LOADER", "decode", "encode"]

LOADER = "refitflow.integrations.sglang.loader.refit"  # --custom-weight-loader, and the load_format
KEY = "refitflow.update"


def encode(init: RefitflowInitInfo, update: RefitflowUpdateInfo, *, tp: int) -> list[str]:
    """``serialized_named_tensors`` for a server of ``tp`` TP ranks (one entry each: SGLang indexes by rank)."""
    if tp < 1:
        raise ConfigError(f"tp must be at least 1, got {tp}")
    body = orjson.dumps({"init": init.to_dict(), "update": update.to_dict()})
    tensor = torch.frombuffer(bytearray(body), dtype=torch.uint8).clone()
    one = base64.b64encode(pickle.dumps([(KEY, tensor)], protocol=pickle.HIGHEST_PROTOCOL)).decode()
    return [one] * tp


def decode(named_tensors: Iterable[tuple[str, Any]]) -> tuple[RefitflowInitInfo, RefitflowUpdateInfo]:
    """The init and update info in what SGLang hands the loader; ``ConfigError`` for anything else."""
    entries = list(named_tensors)
    if len(entries) != 1 or not isinstance(entries[0], tuple) or entries[0][0] != KEY:
        names = [e[0] if isinstance(e, tuple) else type(e).__name__ for e in entries[:4]]
        raise ConfigError(f"refitflow's loader takes one entry named {KEY!r} (refitflow.integrations.sglang."
                          f"payload.encode), got {names}")  # fmt: skip
    tensor = entries[0][1]
    if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.uint8 or tensor.dim() != 1:
        raise ConfigError(f"{KEY!r} must be a 1-D uint8 tensor of JSON")
    try:
        body = orjson.loads(tensor.cpu().numpy().tobytes())
        return RefitflowInitInfo(**body["init"]), RefitflowUpdateInfo(**body["update"])
    except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
        raise ConfigError(f"{KEY!r} does not hold refitflow's init and update info: {exc}") from exc
