"""The inference side of a LoRA refit: ``AdapterReceiver`` lands adapter versions where the engine loads them.

Per version: the publication (exactly the version asked for: the caller serves it under that version's
name), its base version checked against the one this rank serves, every tensor pulled whole (an engine's
LoRA loader takes the whole adapter and shards it itself) into buffers kept per adapter, verified against
the trainer's digests like any refit, then written as a PEFT directory (``files.write``) and older
versions pruned. Nothing is written unless every byte verified, so an engine never finds a partial
adapter. The engine loads the directory through its own LoRA machinery, which applies ``alpha / r``.
"""

from __future__ import annotations

import pathlib
import time
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import anyio
import torch

from refitflow.api.receiver import Receiver
from refitflow.core.dtypes import dtype_from_name
from refitflow.core.errors import VersionError
from refitflow.integrations.lora.adapter import adapter_identity, decode, lora_name
from refitflow.integrations.lora.files import prune, write
from refitflow.registry.client.connect import connect_registry
from refitflow.registry.keys import DeploymentKeys
from refitflow.registry.security import ClientSecurity

__all__ = ["AdapterReceiver", "Landed"]


@dataclass(frozen=True)
class Landed:
    adapter: str
    version: int
    name: str  # the versioned name to serve it under
    path: pathlib.Path
    base_version: int
    nbytes: int  # pulled
    seconds: float  # from finding the publication to the directory written
    pruned: tuple[int, ...]  # versions removed from disk


class AdapterReceiver:
    def __init__(self, registry: Any, *, receiver_id: str, transport: Any = "auto",
                 budget_bytes: int = 64 << 20, security: ClientSecurity | DeploymentKeys | None = None,
                 **receiver_options: Any) -> None:  # fmt: skip
        self._owns_registry = isinstance(registry, str)
        self.registry = connect_registry(registry, security, "rollout")
        self.receiver_id = receiver_id
        self._options = {"transport": transport, "budget_bytes": budget_bytes, **receiver_options}
        self._receivers: dict[str, tuple[Any, dict[str, torch.Tensor], Receiver]] = {}  # adapter -> geometry, ...

    async def __aenter__(self) -> AdapterReceiver:
        return self

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:  # fmt: skip
        await self.aclose()

    async def aclose(self) -> None:
        receivers, self._receivers = self._receivers, {}
        with anyio.CancelScope(shield=True):
            for _, _, receiver in receivers.values():
                await receiver.__aexit__(None, None, None)
            if self._owns_registry:
                await self.registry.aclose()

    async def receive(self, adapter: str, version: int, *, base_version: int, root: pathlib.Path | str,
                      keep: int = 2, timeout: float = 60.0) -> Landed:  # fmt: skip
        """Land ``adapter`` ``version`` under ``root``; this rank serves the base model's ``base_version``."""
        identity = adapter_identity(adapter)
        publication = await self.registry.wait_complete(identity, version, timeout)
        started = time.perf_counter()
        if publication.version != version:
            raise VersionError(f"adapter {adapter!r} version {version} was superseded by version "
                               f"{publication.version}: ask for that one", version=version)  # fmt: skip
        info = decode(publication)
        if info.base_version != base_version:
            raise VersionError(f"adapter {adapter!r} version {version} was trained on base version "
                               f"{info.base_version}; this rank serves base version {base_version}",
                               version=version)  # fmt: skip
        geometry = tuple(sorted({(s.name, s.global_shape, s.dtype) for m in publication.manifests for s in m.shards}))
        buffers, receiver = await self._receiver(adapter, geometry)
        result = await receiver.refit(version, timeout=timeout)
        if result.version != version:
            raise VersionError(f"adapter {adapter!r}: version {result.version} arrived instead of {version}",
                               version=version)  # fmt: skip
        where = pathlib.Path(root)
        path = await anyio.to_thread.run_sync(write, where, adapter, version, buffers, info.config,
                                              publication.revision)  # fmt: skip
        pruned = await anyio.to_thread.run_sync(lambda: prune(where, adapter, newest=version, keep=keep))
        return Landed(adapter=adapter, version=version, name=lora_name(adapter, version), path=path,
                      base_version=base_version, nbytes=result.nbytes, seconds=time.perf_counter() - started,
                      pruned=tuple(pruned))  # fmt: skip

    async def _receiver(self, adapter: str, geometry: Any) -> tuple[dict[str, torch.Tensor], Receiver]:
        """The buffers and receiver of ``adapter``: kept while its geometry stays (delta refits skip what did
        not change), made again when it changed (another ``r``, other target modules)."""
        held = self._receivers.get(adapter)
        if held is not None and held[0] == geometry:
            return held[1], held[2]
        if held is not None:
            del self._receivers[adapter]
            await held[2].__aexit__(None, None, None)
        buffers = {n: torch.zeros(shape, dtype=dtype_from_name(dtype, tensor=n)) for n, shape, dtype in geometry}
        receiver = Receiver(buffers, self.registry, identity=adapter_identity(adapter), mode="in_place",
                            receiver_id=f"{self.receiver_id}-{adapter}", **self._options)  # fmt: skip
        await receiver.__aenter__()
        self._receivers[adapter] = (geometry, buffers, receiver)
        return buffers, receiver
