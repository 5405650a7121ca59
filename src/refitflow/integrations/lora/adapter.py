"""What a LoRA adapter publication is: its identity, its tensors' names, and what its manifests carry.

An adapter is a publication of its own identity (``model`` = the adapter's name, ``layout="peft"``): PEFT's
saved names (``...q_proj.lora_A.weight``, ``...q_proj.lora_B.weight``, ``...lora_embedding_A``; what
``peft.get_peft_model_state_dict(model)`` returns), the raw ``A`` and ``B`` — never ``B`` scaled by
``alpha / r``: the engine applies the scaling, once, from the configuration. Each version's manifests
carry ``metadata["lora"]``: JSON of the base version it was trained on and PEFT's adapter configuration
(``r``, ``lora_alpha``, ``target_modules``, ...), written out as ``adapter_config.json`` where it lands.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from refitflow.core.errors import ConfigError, ManifestError
from refitflow.core.types import Identity, Publication

__all__ = ["LAYOUT", "META", "AdapterInfo", "adapter_identity", "check_config", "check_names", "decode", "encode",
           "lora_name"]  # fmt: skip

LAYOUT = "peft"
META = "lora"
_SUFFIXES = (".lora_A.weight", ".lora_B.weight", ".lora_embedding_A", ".lora_embedding_B")


def adapter_identity(name: str) -> Identity:
    """The identity an adapter called ``name`` is published and received under."""
    if not name or "@" in name or "/" in name:
        raise ConfigError(f"an adapter name is a plain name (no '@' or '/': they make its versioned names), got "
                          f"{name!r}")  # fmt: skip
    return Identity(model=name, layout=LAYOUT)


def lora_name(adapter: str, version: int) -> str:
    """The name version ``version`` is served under: never reused, so no cache can confuse two versions."""
    return f"{adapter}@v{version}"


@dataclass(frozen=True)
class AdapterInfo:
    base_version: int  # the base model's version it was trained on (0: the checkpoint the server booted from)
    config: dict[str, Any]  # PEFT's adapter configuration


def check_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """PEFT's adapter configuration, checked for what an engine needs to apply it."""
    if not isinstance(config, Mapping):
        raise ConfigError(f"the adapter config must be PEFT's configuration as a mapping, got {type(config).__name__}")
    out = json.loads(json.dumps(dict(config), default=_plain))  # PEFT's to_dict() holds sets and enums
    r, alpha = out.get("r"), out.get("lora_alpha")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise ConfigError(f"the adapter config's r must be a positive integer, got {r!r}")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or alpha <= 0:
        raise ConfigError(f"the adapter config's lora_alpha must be a positive number, got {alpha!r}")
    if not out.get("target_modules"):
        raise ConfigError("the adapter config names no target_modules")
    out.setdefault("peft_type", "LORA")
    return out


def _plain(value: Any) -> Any:
    if isinstance(value, set | frozenset):
        return sorted(value, key=str)
    if isinstance(value, enum.Enum):
        return value.value
    return str(value)


def check_names(names: Iterable[str]) -> None:
    """Every tensor is a LoRA matrix under PEFT's saved name."""
    for name in names:
        if not name.endswith(_SUFFIXES):
            hint = "; name them as peft.get_peft_model_state_dict(model) does" if ".lora_" in name else ""
            raise ConfigError(f"{name!r} is not a LoRA tensor under PEFT's saved name (ending {', '.join(_SUFFIXES)})"
                              f"{hint}")  # fmt: skip


def encode(config: Mapping[str, Any], base_version: int) -> dict[str, str]:
    """The manifest metadata of one adapter version."""
    if not isinstance(base_version, int) or isinstance(base_version, bool) or base_version < 0:
        raise ConfigError(f"base_version must be the base model's version (0: its boot checkpoint), got "
                          f"{base_version!r}")  # fmt: skip
    return {META: json.dumps({"base_version": base_version, "config": check_config(config)}, sort_keys=True)}


def decode(publication: Publication) -> AdapterInfo:
    """The adapter's base version and configuration, the same in every rank's manifest."""
    found = {m.metadata.get(META) for m in publication.manifests}
    where = f"adapter {publication.identity.model!r} version {publication.version}"
    if len(found) != 1 or None in found:
        raise ManifestError(f"{where}: its ranks' manifests do not all carry the same metadata[{META!r}]")
    try:
        raw = json.loads(found.pop() or "")
        info = AdapterInfo(base_version=int(raw["base_version"]), config=check_config(raw["config"]))
        check_names(s.name for m in publication.manifests for s in m.shards)
    except (ValueError, KeyError, TypeError, ConfigError) as exc:
        raise ManifestError(f"{where}: not a LoRA adapter publication: {exc}") from exc
    return info
