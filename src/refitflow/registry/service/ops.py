"""The registry service's operations: one request dict in, one JSON-able result out (or a typed error).

Publishing takes a rank's whole manifest (``manifest``, in columns: its layout is then held, by its id) or,
for a layout held, a small record (``record``: revision and digests, the digests a blob of raw bytes; ``layout``:
the layout itself, for one not held yet); ``complete`` takes the digests of a pending announcement alone. What
receivers fetch: ``fetching``; relay joins: ``relay_ops``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from refitflow.core.errors import ManifestError, RefitTimeoutError, VersionError
from refitflow.core.records import (
    Announcement,
    RankLayout,
    RankRecord,
    layout_from_dict,
    record_from_dict,
)
from refitflow.core.types import Manifest
from refitflow.core.wire import manifest_completed, manifest_from_dict
from refitflow.registry.limits import RegistryLimits
from refitflow.registry.messages import identity_from_dict, identity_to_dict
from refitflow.registry.protocol import Store
from refitflow.registry.release import ReleasePolicy
from refitflow.registry.service.args import OFF_LOOP_SHARDS, arg, blob_arg, off_loop_if, rows
from refitflow.registry.service.fetching import FetchOps
from refitflow.registry.service.parts import Parts
from refitflow.registry.service.relay_ops import RelayOps

__all__ = ["MAX_WAIT_S", "OFF_LOOP_SHARDS", "Handler"]

MAX_WAIT_S = 30.0  # the longest a server-side wait lasts before the client asks again
_BIG_DIGESTS = 1 << 16  # a record with more digests than this is checked in a worker thread


class Handler(FetchOps, RelayOps):
    def __init__(
        self, registry: Store, *, hello: dict[str, Any], limits: RegistryLimits,
        announce: Callable[[dict[str, str], int], Awaitable[None]],
    ) -> None:  # fmt: skip
        self.registry = registry
        self._hello = hello
        self.limits = limits
        self._announce = announce
        self._checking = anyio.CapacityLimiter(2)  # large manifests checked at once (CPU and memory)
        self._parts = Parts()
        self._wire = {}

    async def _rows(self, d: dict[str, Any], parts: tuple[str, ...], decode: Callable[[Any], Any]) -> Any:
        """Decode a manifest or layout within ``max_shards`` rows; a large one in a worker thread."""
        count = sum(rows(d.get(k)) for k in parts)
        if count > self.limits.max_shards:
            raise ManifestError(f"{count} shard specs in one manifest, over the registry's limit of "
                                f"{self.limits.max_shards}")  # fmt: skip
        return await off_loop_if(count > OFF_LOOP_SHARDS, self._checking, decode, d)

    async def handle(self, msg: dict[str, Any]) -> Any:
        op = msg.get("op")
        method = getattr(self, f"op_{op}", None) if isinstance(op, str) else None
        if method is None:
            raise ManifestError(f"unknown operation {op!r:.40}")
        return await method(msg)

    async def op_hello(self, msg: dict[str, Any]) -> Any:
        return self._hello

    async def op_goodbye(self, msg: dict[str, Any]) -> Any:
        await self.registry.goodbye(arg(msg, "owner", str))

    async def op_heartbeat(self, msg: dict[str, Any]) -> Any:
        known = await self.registry.heartbeat(arg(msg, "owner", str))
        return {"known": known, "lease_s": self.registry.lease_s}

    # -- publishing ------------------------------------------------------------------------------------

    async def op_publish(self, msg: dict[str, Any]) -> Any:
        """A rank's whole manifest, or its record (and its layout, if not held)."""
        owner = arg(msg, "owner", str)  # a remote publish is lease-bound: it ends with its client
        if "record" not in msg:
            manifest: Manifest = await self._rows(arg(msg, "manifest", dict), ("shards",), manifest_from_dict)
            await self.registry.publish(manifest, owner=owner)
            await self._announced(manifest.identity, manifest.version)
            return
        record = record_from_dict(arg(msg, "record", dict))
        if "layout" in msg:
            layout = await self._rows(arg(msg, "layout", dict), ("shards",), _layout)
            await self.registry.add_layout(layout)
        await self._publish(record, owner)

    async def op_complete(self, msg: dict[str, Any]) -> Any:
        """Two-phase publication's second message: the digests of a manifest announced pending (its layout is
        held here already) — raw (``digests`` a blob, with ``revision``) or as columns (``digests_to_dict``); a
        ``VersionError`` when no pending announcement is held (the client then publishes the whole manifest)."""
        owner = arg(msg, "owner", str)
        identity = identity_from_dict(arg(msg, "identity", dict))
        version, rank = arg(msg, "version", int), arg(msg, "rank", int)
        pending = self.registry.entry(identity, version, rank)
        if pending is None or not pending.pending:
            raise VersionError(f"rank {rank} has no pending announcement of this version here", version=version)
        if isinstance(msg.get("digests"), dict):  # the digests as columns
            d = msg["digests"]
            many = len(pending.layout.manifest.shards) > OFF_LOOP_SHARDS
            full = await off_loop_if(many, self._checking, manifest_completed, pending.manifest, d)
            await self.registry.publish(full, owner=owner)
            await self._announced(full.identity, full.version)
            return
        record = RankRecord(identity=identity, version=version, rank=rank, layout=pending.layout.id,
                            revision=arg(msg, "revision", str), digests=blob_arg(msg, "digests"))  # fmt: skip
        await self._publish(record, owner)

    async def _publish(self, record: RankRecord, owner: str) -> None:
        big = record.digests is not None and len(record.digests) > 8 * _BIG_DIGESTS
        entry: Announcement = await off_loop_if(big, self._checking, self.registry.entry_of, record)
        await self.registry.publish_entry(entry, owner=owner)
        await self._announced(entry.identity, entry.version)

    async def _announced(self, identity: Any, version: int) -> None:
        # complete, or laid out (early readers); a store that announces itself does (etcd: from its watch)
        if not self.registry.announces and self.registry.is_newest(identity, version):
            await self._announce(identity_to_dict(identity), version)

    # -- receivers and releases ------------------------------------------------------------------------

    async def op_register_receiver(self, msg: dict[str, Any]) -> Any:
        identity = identity_from_dict(arg(msg, "identity", dict))
        await self.registry.register_receiver(identity, arg(msg, "receiver_id", str),
                                              owner=arg(msg, "owner", str, None))  # fmt: skip

    async def op_unregister_receiver(self, msg: dict[str, Any]) -> Any:
        identity = identity_from_dict(arg(msg, "identity", dict))
        await self.registry.unregister_receiver(identity, arg(msg, "receiver_id", str))

    async def op_report(self, msg: dict[str, Any]) -> Any:
        identity = identity_from_dict(arg(msg, "identity", dict))
        await self.registry.report(identity, arg(msg, "receiver_id", str), arg(msg, "version", int))

    async def op_is_released(self, msg: dict[str, Any]) -> Any:
        identity = identity_from_dict(arg(msg, "identity", dict))
        policy = ReleasePolicy.from_dict(msg.get("policy"))
        return await self.registry.is_released(identity, arg(msg, "version", int), policy=policy)

    async def op_acked(self, msg: dict[str, Any]) -> Any:
        identity = identity_from_dict(arg(msg, "identity", dict))
        return list(await self.registry.acked(identity, arg(msg, "version", int)))

    async def op_wait_released(self, msg: dict[str, Any]) -> Any:
        """Wait up to ``wait_s`` (at most MAX_WAIT_S); the result says whether it was released."""
        identity = identity_from_dict(arg(msg, "identity", dict))
        policy = ReleasePolicy.from_dict(msg.get("policy"))
        wait_s = min(max(float(arg(msg, "wait_s", (int, float))), 0.0), MAX_WAIT_S)
        try:
            await self.registry.wait_released(identity, arg(msg, "version", int), wait_s, policy=policy)
        except RefitTimeoutError:
            return False
        return True

    async def op_near_misses(self, msg: dict[str, Any]) -> Any:
        identity = identity_from_dict(arg(msg, "identity", dict))
        return await self.registry.near_misses(identity, arg(msg, "min_version", int, 0))

    async def op_versions(self, msg: dict[str, Any]) -> Any:
        return await self.registry.versions(identity_from_dict(arg(msg, "identity", dict)))


def _layout(d: Any) -> RankLayout:
    return RankLayout(layout_from_dict(d))
