"""An adapter version as a PEFT directory an engine's own LoRA loader reads: written whole or not at all.

``<root>/<adapter>@v<version>/``: ``adapter_model.safetensors``, ``adapter_config.json``, and
``refitflow.json`` (the publication's revision). The directory appears by one rename of a complete
temporary one, so an engine never reads half of it; a directory already there with the same revision (a
peer worker on this host wrote it) is kept, one with another revision is an error (versions are never
reused). ``prune`` removes this adapter's versions older than the newest ``keep``.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import uuid
from collections.abc import Mapping
from typing import Any

import torch

from refitflow.core.errors import VersionError
from refitflow.integrations.lora.adapter import lora_name

__all__ = ["prune", "write"]

MARKER = "refitflow.json"


def write(root: pathlib.Path, adapter: str, version: int, tensors: Mapping[str, torch.Tensor],
          config: Mapping[str, Any], revision: str) -> pathlib.Path:  # fmt: skip
    from safetensors.torch import save_file

    root.mkdir(parents=True, exist_ok=True)
    final = root / lora_name(adapter, version)
    marker = {"adapter": adapter, "version": version, "revision": revision}
    if _same(final, marker):
        return final
    tmp = root / f".{final.name}.{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        save_file({n: t.detach().contiguous() for n, t in tensors.items()}, str(tmp / "adapter_model.safetensors"))
        (tmp / "adapter_config.json").write_text(json.dumps(dict(config), indent=2, sort_keys=True))
        (tmp / MARKER).write_text(json.dumps(marker))
        try:
            os.rename(tmp, final)
        except OSError:  # there already: a peer worker on this host wrote the same version first
            if not _same(final, marker):
                raise VersionError(f"{final} already holds other bytes for adapter {adapter!r} version {version} "
                                   "(versions are never reused)", version=version) from None  # fmt: skip
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def prune(root: pathlib.Path, adapter: str, *, newest: int, keep: int) -> list[int]:
    """Remove this adapter's versions below the newest ``keep`` up to ``newest``; the versions removed."""
    pattern = re.compile(re.escape(adapter) + r"@v(\d+)")
    versions = sorted(int(m.group(1)) for p in root.iterdir() if (m := pattern.fullmatch(p.name)))
    kept = [v for v in versions if v <= newest][-keep:]
    gone = [v for v in versions if v < newest and v not in kept]
    for v in gone:
        shutil.rmtree(root / lora_name(adapter, v), ignore_errors=True)
    return gone


def _same(path: pathlib.Path, marker: dict[str, Any]) -> bool:
    try:
        return bool(json.loads((path / MARKER).read_text()) == marker)
    except (OSError, ValueError):
        return False
