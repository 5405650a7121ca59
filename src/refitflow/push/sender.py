"""StreamSender: a trainer rank broadcasting one version of its weights in the stream's frozen format.

Tensors are bucketed by the frozen rule (``format.bucket_ranges``) and packed back to back into one
reused buffer of ``bucket_bytes``; a bucket of one contiguous tensor (an oversize tensor travels
alone) is broadcast straight from the tensor's memory, with no copy. A send that stops half-way
(a failed broadcast, a cancellation) tears down this end of the group: the receivers' next
collective fails at once instead of waiting for frames that will never come.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import anyio.to_thread
import torch

from refitflow.core.errors import ConfigError, VersionError
from refitflow.push.config import StreamSenderConfig
from refitflow.push.format import CMD_BUCKET, Entry, Header, bucket_ranges, encode_metadata, pack_offsets
from refitflow.push.group import StreamGroup
from refitflow.transports.base import as_bytes

__all__ = ["SendResult", "StreamSender"]

INT64_MAX = 2**63 - 1


@dataclass(frozen=True, kw_only=True)
class SendResult:
    version: int
    buckets: int
    nbytes: int  # payload bytes broadcast
    seconds: float


class StreamSender:
    def __init__(
        self, group: StreamGroup, *, bucket_bytes: int = StreamSenderConfig.bucket_bytes, src: int = 0
    ) -> None:
        self.config = StreamSenderConfig(bucket_bytes=bucket_bytes, src=src)
        if group.rank != src:
            raise ConfigError(f"the sender must be group rank src={src}, this is rank {group.rank}")
        self.group = group
        self.last_version: int | None = None
        self._buffer: torch.Tensor | None = None  # the packing buffer, reused bucket after bucket

    async def send(
        self, version: int, tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
    ) -> SendResult:
        """Broadcast every tensor as version ``version``, then the end marker."""
        items = list(tensors.items() if isinstance(tensors, Mapping) else tensors)
        self._check(version, items)
        t0 = time.perf_counter()
        ranges = bucket_ranges([t.numel() * t.element_size() for _, t in items], self.config.bucket_bytes)
        begun = done = False
        try:
            for r in ranges:
                chunk = items[r.start : r.stop]
                entries = pack_offsets(chunk)
                payload = await anyio.to_thread.run_sync(self._pack, chunk, entries)
                begun = True
                await self._broadcast(version, encode_metadata(entries), payload)
            await self.group.broadcast(Header.end(version).tensor(self.group.device), self.config.src)
            done = True
        finally:
            if begun:  # the receivers began this version: it is spent, sent whole or not
                self.last_version = version
            if begun and not done:  # the receivers are mid-stream: they must not wait for the rest
                self.group.close()
        nbytes = sum(t.numel() * t.element_size() for _, t in items)
        return SendResult(version=version, buckets=len(ranges), nbytes=nbytes, seconds=time.perf_counter() - t0)

    def _check(self, version: int, items: list[tuple[str, torch.Tensor]]) -> None:
        if not isinstance(version, int) or not 0 <= version <= INT64_MAX:
            raise ConfigError(f"version must be a non-negative 64-bit integer, got {version!r}")
        if self.last_version is not None and version <= self.last_version:
            raise VersionError(f"version must increase: this sender last sent {self.last_version}", version=version)
        if not items:
            raise ConfigError("nothing to send: a stream needs at least one tensor", version=version)
        names: set[str] = set()
        for name, t in items:
            if not isinstance(t, torch.Tensor) or t.numel() == 0:
                raise ConfigError("every entry must be a tensor with at least one element", tensor=name)
            if name in names:
                raise ConfigError("a name may be sent once per version", tensor=name)
            names.add(name)

    async def _broadcast(self, version: int, metadata: bytes, payload: torch.Tensor) -> None:
        """One bucket's three broadcasts: header, metadata, payload."""
        header = Header(CMD_BUCKET, len(metadata), payload.numel(), version)
        device, src = self.group.device, self.config.src
        await self.group.broadcast(header.tensor(device), src)
        await self.group.broadcast(torch.frombuffer(bytearray(metadata), dtype=torch.uint8).to(device), src)
        await self.group.broadcast(payload, src)

    def _pack(self, items: list[tuple[str, torch.Tensor]], entries: list[Entry]) -> torch.Tensor:
        device = self.group.device
        if len(items) == 1:  # travels alone: its own bytes are the payload (no copy when contiguous)
            return as_bytes(items[0][1].detach().contiguous().to(device))
        total = entries[-1].offset + entries[-1].nbytes  # ≤ bucket_bytes (the rule flushed before overflowing)
        if self._buffer is None:
            self._buffer = torch.empty(self.config.bucket_bytes, dtype=torch.uint8, device=device)
        buf = self._buffer[:total]
        for (_, t), e in zip(items, entries, strict=True):
            buf[e.offset : e.offset + e.nbytes].copy_(as_bytes(t.detach().contiguous()))
        return buf
