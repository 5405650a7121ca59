"""The trainer's side of a LoRA refit: ``AdapterPublisher`` publishes an adapter's versions.

::

    from peft import get_peft_model_state_dict

    async with AdapterPublisher("tcp://registry:7100", name="policy-lora",
                                config=peft_model.peft_config["default"].to_dict()) as pub:
        await pub.publish(step, get_peft_model_state_dict(peft_model), base_version=0)

A sharded trainer publishes from every rank (``rank``, ``world_size``), each what it holds: ``rf.Sharded``
parts (Megatron's row- or column-parallel ``B``/``A``) or FSDP2 ``DTensor`` local shards, as with
``rf.Publisher`` — receivers assemble whole matrices. ``base_version``: the base model's version the adapter
was trained on (0: the checkpoint the servers booted from); a server serving another refuses it.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import TracebackType
from typing import Any

import torch

from refitflow.api.publisher import Publisher, Sharded
from refitflow.core.types import Manifest
from refitflow.integrations.lora.adapter import adapter_identity, check_config, check_names, encode

__all__ = ["AdapterPublisher"]


class AdapterPublisher:
    def __init__(self, registry: Any, *, name: str, config: Mapping[str, Any], **publisher_options: Any) -> None:
        """``registry`` and ``publisher_options`` (``rank``, ``world_size``, ``transport``, ...): ``rf.Publisher``'s."""
        self.name = name
        self.config = check_config(config)
        self.publisher = Publisher(registry, identity=adapter_identity(name), **publisher_options)

    async def __aenter__(self) -> AdapterPublisher:
        await self.publisher.__aenter__()
        return self

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:  # fmt: skip
        await self.publisher.__aexit__(et, e, tb)

    async def publish(self, version: int, tensors: Mapping[str, torch.Tensor | Sharded], *,
                      base_version: int) -> Manifest:  # fmt: skip
        """Publish this rank's adapter tensors as ``version``, trained on the base model's ``base_version``."""
        check_names(tensors)
        return await self.publisher.publish(version, tensors, metadata=encode(self.config, base_version))

    async def released(self, version: int, timeout: float | None = None) -> None:
        await self.publisher.released(version, timeout)
