"""Publisher: a trainer rank announces each version of its shards; receivers read them in place.

The publisher never copies or mutates the trainer's tensors. It registers each tensor's memory with
the transport once per storage (a new storage is registered anew, and the address re-announced),
digests the bytes, and publishes a manifest. The trainer must not change the tensors of a version
until ``await pub.released(version)`` returns.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Protocol

import anyio.to_thread
import torch
import xxhash

from refitflow.core.dtypes import dtype_name
from refitflow.core.errors import ConfigError
from refitflow.core.types import Identity, Manifest, ShardSpec
from refitflow.metrics import NULL_OBSERVER, PublishObserver
from refitflow.registry.connect import connect_registry
from refitflow.registry.release import ReleasePolicy
from refitflow.transports import Transport, as_bytes, make_transport

__all__ = ["Publisher", "Sharded"]


@dataclass(frozen=True, kw_only=True)
class Sharded:
    """The part of a tensor this rank holds: ``tensor`` is ``global[start:stop]`` along ``axis``."""

    tensor: torch.Tensor
    axis: int
    start: int
    global_shape: tuple[int, ...]


class PublishRegistry(Protocol):
    async def publish(self, manifest: Manifest) -> None: ...
    async def wait_released(
        self, identity: Identity, version: int, timeout: float | None, *, policy: ReleasePolicy | None = None
    ) -> None: ...
    async def is_released(self, identity: Identity, version: int, *, policy: ReleasePolicy | None = None) -> bool: ...
    async def acked(self, identity: Identity, version: int) -> tuple[int, int]: ...


BLOCK_ROWS = 64
BLOCK_MAX_BYTES = 4 << 20


def block_rows(shape: tuple[int, ...], item: int) -> int:
    """Rows of dim 0 per digest block: 64 (1-D: up to 4 MiB), fewer when 64 rows exceed 4 MiB."""
    row = math.prod(shape[1:]) * item
    cap = max(1, BLOCK_MAX_BYTES // max(row, 1))
    rows = shape[0] if shape else 1
    return max(1, min(rows, cap if len(shape) <= 1 else min(BLOCK_ROWS, cap)))


def digest(tensor: torch.Tensor) -> tuple[str, int, str]:
    """(digest, block rows, base64 block digests) of a contiguous CPU tensor's bytes."""
    data = as_bytes(tensor)
    rows = block_rows(tuple(tensor.shape), tensor.element_size())
    step = rows * (data.numel() // max(tensor.shape[0], 1) if tensor.dim() else data.numel())
    raw = b"".join(
        xxhash.xxh3_64(data[i : i + step].numpy().data).digest() for i in range(0, max(data.numel(), 1), step)
    )
    return xxhash.xxh3_64(raw).hexdigest(), rows, base64.b64encode(raw).decode()


class Publisher:
    def __init__(
        self,
        registry: PublishRegistry | str,
        *,
        identity: Identity,
        rank: int = 0,
        world_size: int = 1,
        transport: str | Transport = "loopback",
        metadata: Mapping[str, str] | None = None,
        compile_target: str = "",
        compile_metadata: Mapping[str, str] | None = None,
        observer: PublishObserver = NULL_OBSERVER,
        release_policy: ReleasePolicy | None = None,
    ) -> None:
        """``registry``: a registry object, or the address of a registry service (a client is opened and
        closed with the publisher). ``release_policy``: when ``released(version)`` returns (see ReleasePolicy).
        """
        if not 0 <= rank < world_size:
            raise ConfigError(f"rank {rank} must lie in [0, world_size={world_size})")
        self._owns_registry = isinstance(registry, str)
        self.registry: PublishRegistry = connect_registry(registry)
        self.release_policy = release_policy
        self.identity = identity
        self.rank = rank
        self.world_size = world_size
        self.metadata = dict(metadata or {})
        self.compile = dict(
            compile_target=compile_target, compile_metadata=tuple(sorted((compile_metadata or {}).items()))
        )
        self.observer = observer
        self._transport_spec = transport
        self._transport: Transport | None = None
        self._regions_by_version: dict[int, set[int]] = {}
        self._known_regions: set[int] = set()
        self.published: list[int] = []

    async def __aenter__(self) -> Publisher:
        try:
            # off the loop: a real transport imports its library and creates its agent (seconds)
            self._transport = await anyio.to_thread.run_sync(make_transport, self._transport_spec)
        except BaseException:
            await self._close()  # a failed enter leaks nothing (an owned registry client included)
            raise
        transport = self._transport
        self.observer.watch_served(lambda: transport.served_bytes)
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self._close()

    async def _close(self) -> None:
        with anyio.CancelScope(shield=True):
            try:
                if self._transport is not None:
                    await self._transport.aclose()
            finally:
                self._transport = None
                if self._owns_registry:
                    await self.registry.aclose()  # type: ignore[attr-defined]

    @property
    def transport(self) -> Transport:
        if self._transport is None:
            raise ConfigError("use the publisher inside 'async with'")
        return self._transport

    def _spec(self, name: str, value: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        if isinstance(value, Sharded):
            tensor, axis, start = value.tensor, value.axis, value.start
            shape = tuple(value.global_shape)
            stop = start + tensor.shape[axis]
        elif isinstance(value, torch.Tensor):
            tensor, axis, shape = value, None, tuple(value.shape)
            start, stop = 0, (shape[0] if shape else 1)
        else:
            raise ConfigError(f"{name!r}: expected a tensor or rf.Sharded, got {type(value).__name__}")
        if not tensor.is_contiguous():
            raise ConfigError(f"{name!r} is not contiguous; refitflow never copies the trainer's tensors")
        if tensor.device.type != "cpu" and self.transport.name != "nixl":
            raise ConfigError(f"{name!r} is on {tensor.device}; the {self.transport.name} transport needs CPU")
        fields = dict(
            dtype=dtype_name(tensor.dtype, tensor=name),
            global_shape=shape,
            axis=axis,
            start=start,
            stop=stop,
            **self.compile,
        )
        return tensor.detach(), fields

    async def publish(self, version: int, tensors: Mapping[str, torch.Tensor | Sharded]) -> Manifest:
        """Register, digest and announce this rank's tensors as ``version``."""
        if self.published and version <= self.published[-1]:
            raise ConfigError(f"version {version} does not increase past {self.published[-1]}")
        prepared = [(name, *self._spec(name, value)) for name, value in tensors.items()]
        regions = {name: self.transport.register(t) for name, t, _ in prepared}

        def digest_all() -> list[tuple[str, int, str]]:
            return [digest(t) for _, t, _ in prepared]

        digests = await anyio.to_thread.run_sync(digest_all)
        shards = tuple(
            ShardSpec(name=name, digest=d, block_rows=rows, blocks=blocks, region=regions[name], **fields)
            for (name, _, fields), (d, rows, blocks) in zip(prepared, digests, strict=True)
        )
        manifest = Manifest(
            identity=self.identity,
            version=version,
            rank=self.rank,
            world_size=self.world_size,
            source=self.transport.address(),
            shards=shards,
            metadata=self.metadata,
        )
        await self.registry.publish(manifest)
        self.observer.version_published(version, sum(s.nbytes for s in shards))
        self.published.append(version)
        self._regions_by_version[version] = set(regions.values())
        self._known_regions |= set(regions.values())
        await self._forget_released()
        return manifest

    async def released(self, version: int, timeout: float | None = None) -> None:
        """Return when ``version`` is released per the release policy (its tensors may change then)."""
        await self.registry.wait_released(self.identity, version, timeout, policy=self.release_policy)
        done, registered = await self.registry.acked(self.identity, version)
        self.observer.receivers_acked(done, registered)

    async def _forget_released(self) -> None:
        """Deregister memory only released versions still referenced."""
        latest = self.published[-1]
        for version in [v for v in self._regions_by_version if v != latest]:
            if await self.registry.is_released(self.identity, version, policy=self.release_policy):
                del self._regions_by_version[version]
        keep: set[int] = set().union(*self._regions_by_version.values())
        for region in self._known_regions - keep:
            self.transport.deregister(region)
        self._known_regions = keep
