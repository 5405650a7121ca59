"""The trainer side of the verl backend: every actor rank publishes its part of each version.

verl hands ``send_weights`` the trainer's weights as ``(name, tensor)`` pairs, HF-named:

- a ``DTensor`` (FSDP2's parameters, e.g. from ``module.state_dict()``) is published where it lies,
  its local shard only (``api/dtensor.py``): nothing is gathered or copied;
- a plain tensor (verl's ``get_per_tensor_param`` gathers each FSDP / Megatron tensor whole on every
  rank and frees it after the next one) is cut by rows across the actor ranks: each rank keeps only
  its ``torch.chunk`` of the rows, copied into a buffer of its own that stays registered with the
  transport from version to version. Together the ranks publish every row once, each holding
  1/world of the model, and the inference ranks read from all of them.

``TrainerSide`` runs the publisher (and, on rank 0 when no registry address is configured, the
registry service) on a ``LoopThread`` of its own, so they outlive each of verl's calls.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterable, Iterable
from typing import Any

import torch

from refitflow.api.dtensor import chunk_range, is_dtensor
from refitflow.api.publisher import Publisher, Sharded
from refitflow.core.errors import ConfigError
from refitflow.integrations.hosting.keys import deployment_keys
from refitflow.integrations.hosting.loop_thread import LoopThread
from refitflow.integrations.verl.config import VerlBackendConfig
from refitflow.registry.keys import client_of, server_of
from refitflow.registry.release import ReleasePolicy
from refitflow.registry.service.embedded import Registry

__all__ = ["TrainerSide", "collect"]


class _Rows:
    """This rank's rows of whole tensors, in buffers reused across versions (same storage, registered once)."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self.buffers: dict[str, torch.Tensor] = {}

    def part(self, name: str, tensor: torch.Tensor) -> torch.Tensor | Sharded | None:
        rows = tensor.shape[0] if tensor.dim() else 1
        start, stop = chunk_range(rows, self.world_size, self.rank)
        if start == stop:
            return None
        piece = tensor.detach().reshape(1) if not tensor.dim() else tensor.detach()[start:stop]
        buf = self.buffers.get(name)
        if buf is None or buf.shape != piece.shape or buf.dtype != piece.dtype or buf.device != piece.device:
            buf = self.buffers[name] = torch.empty_like(piece, memory_format=torch.contiguous_format)
        buf.copy_(piece)
        if not tensor.dim():
            return buf.reshape(())
        return Sharded(tensor=buf, axis=0, start=start, global_shape=tuple(tensor.shape))


async def collect(
    weights: Iterable[tuple[str, Any]] | AsyncIterable[tuple[str, Any]], rows: _Rows
) -> dict[str, torch.Tensor | Sharded]:
    """This rank's part of every tensor of ``weights`` (consumed here, on the caller's thread: verl's
    generators run collectives as they go)."""
    out: dict[str, torch.Tensor | Sharded] = {}

    def take(name: str, value: Any) -> None:
        if name in out:
            raise ConfigError(f"send_weights: {name!r} appears twice in one version")
        if not isinstance(value, torch.Tensor):
            raise ConfigError(f"send_weights: {name!r} is a {type(value).__name__}, not a tensor")
        if is_dtensor(value):
            out[name] = value  # its local shard, in place (the publisher reads its placements)
        elif (part := rows.part(name, value)) is not None:
            out[name] = part

    if isinstance(weights, AsyncIterable):
        async for name, value in weights:
            take(name, value)
    else:
        for name, value in weights:
            take(name, value)
    return out


class TrainerSide:
    """One actor rank's publisher (opened at its first version), and rank 0's registry service if it serves one."""

    def __init__(self, config: VerlBackendConfig) -> None:
        self.config = config
        self.loop = LoopThread("refitflow-verl-trainer")
        self._stack = contextlib.AsyncExitStack()
        self.registry_address: str | None = config.registry
        self.keys = deployment_keys("trainer")  # CURVE on the registry served here and on the publisher's client
        self.publisher: Publisher | None = None
        self.rows: _Rows | None = None

    def serve_registry(self) -> str:
        """Rank 0 without a configured registry: serve one for as long as the backend lives."""
        if self.registry_address is None:

            async def serve() -> str:
                server = await self._stack.enter_async_context(
                    Registry.serve(self.config.registry_bind, security=server_of(self.keys), insecure=self.keys is None)
                )
                return str(server.address)

            self.registry_address = self.loop.run(
                serve, timeout=self.config.init_timeout_s, what="serving the registry"
            )
        return self.registry_address

    def open(self, *, registry: str, rank: int, world_size: int, receivers: int) -> None:
        """Open this rank's publisher (once; verl calls ``init_process_group`` before every update)."""
        if self.publisher is not None:
            if (self.publisher.rank, self.publisher.world_size) != (rank, world_size):
                raise ConfigError(
                    f"the actor group changed from rank {self.publisher.rank} of {self.publisher.world_size} to "
                    f"{rank} of {world_size}: refitflow's publisher keeps its rank; restart the backend"
                )
            return

        async def start() -> Publisher:
            pub = Publisher(
                registry, identity=self.config.full_identity, rank=rank, world_size=world_size, transport="nixl",
                digest=self.config.digest, announce_early=self.config.announce_early,
                release_policy=ReleasePolicy(receivers=receivers), security=client_of(self.keys),
            )  # fmt: skip
            return await self._stack.enter_async_context(pub)

        self.publisher = self.loop.run(start, timeout=self.config.init_timeout_s, what="opening the publisher")
        self.rows = _Rows(rank, world_size)

    def next_version(self, global_steps: int | None) -> int:
        last = self.publisher.published[-1] if self.publisher and self.publisher.published else 0
        return global_steps if global_steps is not None and global_steps > last else last + 1

    def publish(self, version: int, tensors: dict[str, torch.Tensor | Sharded]) -> dict[str, float]:
        """Publish ``version`` and wait until every inference rank is done with it; verl's metrics."""
        pub = self._publisher()
        start = time.perf_counter()
        manifest = self.loop.run(pub.publish, version, tensors, timeout=self.config.publish_timeout_s,
                                 what=f"publishing version {version}")  # fmt: skip
        published = time.perf_counter()
        self.loop.run(pub.released, version, timeout=self.config.release_timeout_s,
                      what=f"waiting for the inference ranks to be done with version {version}")  # fmt: skip
        return {
            "refitflow/version": float(version),
            "refitflow/published_bytes": float(sum(s.nbytes for s in manifest.shards)),
            "refitflow/publish_s": published - start,
            "refitflow/release_wait_s": time.perf_counter() - published,
        }

    def _publisher(self) -> Publisher:
        if self.publisher is None:
            raise ConfigError("send_weights before init_process_group: verl's manager calls prepare, then it")
        return self.publisher

    def close(self) -> None:
        try:
            self.loop.run(self._stack.aclose, timeout=self.config.init_timeout_s, what="closing refitflow")
        finally:
            self.loop.close()
