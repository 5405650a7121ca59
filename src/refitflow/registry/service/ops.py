"""The registry service's operations: one request dict in, one JSON-able result out (or a typed error)."""

from __future__ import annotations

import weakref
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import anyio
import anyio.to_thread
import orjson

from refitflow.core.errors import ManifestError, RefitTimeoutError, VersionError
from refitflow.core.fanout import RelayLayouts, RelayOffer
from refitflow.core.types import Manifest
from refitflow.core.wire import (
    encode,
    manifest_completed,
    manifest_from_dict,
    manifest_to_dict,
    offer_from_dict,
    offer_to_dict,
)
from refitflow.registry.limits import RegistryLimits
from refitflow.registry.messages import identity_from_dict, identity_to_dict
from refitflow.registry.protocol import Store
from refitflow.registry.release import ReleasePolicy

__all__ = ["MAX_WAIT_S", "OFF_LOOP_SHARDS", "WIRE_CACHE", "Handler"]

MAX_WAIT_S = 30.0  # the longest a server-side wait lasts before the client asks again
OFF_LOOP_SHARDS = 256  # a manifest with more shard specs than this is checked in a worker thread
WIRE_CACHE = 256  # manifests kept encoded for the next fetch (a version of 256 ranks; one rank of 256 versions)


def _arg(msg: dict[str, Any], name: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
    value = msg.get(name, default)
    if value is ...:
        raise ManifestError(f"request {msg.get('op')!r:.30} lacks {name!r}")
    if value is not default and ((isinstance(value, bool) and kind is not bool) or not isinstance(value, kind)):
        raise ManifestError(f"request argument {name!r} has the wrong type {type(value).__name__}")
    return value


def _rows(value: Any) -> int:
    """How many rows a list (a relay offer's tensors or boxes) or a column form (a manifest's shards) holds."""
    if isinstance(value, list):
        return len(value)
    count = value.get("count") if isinstance(value, dict) else None
    return count if type(count) is int else 0


def _filters(msg: dict[str, Any]) -> dict[str, Any]:
    targets = _arg(msg, "compile_targets", list, None)
    metadata = _arg(msg, "metadata", dict, None)
    if targets is not None and not all(isinstance(t, str) for t in targets):
        raise ManifestError("compile_targets must be a list of strings")
    if metadata is not None and not all(isinstance(v, str) for v in metadata.values()):
        raise ManifestError("metadata filter values must be strings")
    skip = _arg(msg, "skip", list, [])
    if len(skip) > 64 or not all(type(v) is int for v in skip):
        raise ManifestError("skip is a list of at most 64 version numbers")
    return {"compile_targets": targets, "metadata": metadata, "early": _arg(msg, "early", bool, False),
            "skip": skip}  # fmt: skip


class Handler:
    def __init__(
        self, registry: Store, *, hello: dict[str, Any], limits: RegistryLimits,
        announce: Callable[[dict[str, str], int], Awaitable[None]],
    ) -> None:  # fmt: skip
        self.registry = registry
        self._hello = hello
        self.limits = limits
        self._announce = announce
        self._checking = anyio.CapacityLimiter(2)  # large manifests checked at once (CPU and memory)
        self._layouts = RelayLayouts()  # relay geometries seen in whole offers (compact offers name them)
        self._wire: dict[int, tuple[weakref.ref[Manifest], orjson.Fragment]] = {}  # id -> (manifest, its bytes)

    async def _manifest(self, msg: dict[str, Any]) -> Manifest:
        """The request's manifest, checked; a large one off the event loop, so everyone else is served."""
        d = _arg(msg, "manifest", dict)
        manifest: Manifest = await self._decode(d, ("shards",), manifest_from_dict)
        return manifest

    async def _decode(self, d: dict[str, Any], parts: tuple[str, ...], decode: Callable[[Any], Any]) -> Any:
        """Decode a manifest or relay offer within ``max_shards`` rows; a large one in a worker thread."""
        count = sum(_rows(d.get(k)) for k in parts)
        if count > self.limits.max_shards:
            raise ManifestError(f"{count} shard specs in one manifest, over the registry's limit of "
                                f"{self.limits.max_shards}")  # fmt: skip
        if count <= OFF_LOOP_SHARDS:
            return decode(d)
        return await anyio.to_thread.run_sync(decode, d, limiter=self._checking)

    async def handle(self, msg: dict[str, Any]) -> Any:
        op = msg.get("op")
        method = getattr(self, f"op_{op}", None) if isinstance(op, str) else None
        if method is None:
            raise ManifestError(f"unknown operation {op!r:.40}")
        return await method(msg)

    async def op_hello(self, msg: dict[str, Any]) -> Any:
        return self._hello

    async def op_goodbye(self, msg: dict[str, Any]) -> Any:
        await self.registry.goodbye(_arg(msg, "owner", str))

    async def op_heartbeat(self, msg: dict[str, Any]) -> Any:
        known = await self.registry.heartbeat(_arg(msg, "owner", str))
        return {"known": known, "lease_s": self.registry.lease_s}

    async def op_publish(self, msg: dict[str, Any]) -> Any:
        owner = _arg(msg, "owner", str)  # a remote publish is lease-bound: it ends with its client
        await self._publish(await self._manifest(msg), owner)

    async def op_complete(self, msg: dict[str, Any]) -> Any:
        """Two-phase publication's second message: the digests of a manifest announced pending (its layout is
        held here already); a ``VersionError`` when it is not (the client then publishes the whole manifest)."""
        owner = _arg(msg, "owner", str)
        identity = identity_from_dict(_arg(msg, "identity", dict))
        version, rank = _arg(msg, "version", int), _arg(msg, "rank", int)
        pending = self.registry.announced(identity, version, rank)
        if pending is None or not pending.pending:
            raise VersionError(f"rank {rank} has no pending announcement of this version here", version=version)
        d = _arg(msg, "digests", dict)
        if len(pending.shards) <= OFF_LOOP_SHARDS:
            manifest = manifest_completed(pending, d)
        else:
            manifest = await anyio.to_thread.run_sync(manifest_completed, pending, d, limiter=self._checking)
        await self._publish(manifest, owner)

    async def _publish(self, manifest: Manifest, owner: str) -> None:
        await self.registry.publish(manifest, owner=owner)
        # complete, or laid out (early readers); a store that announces itself does (etcd: from its watch)
        if not self.registry.announces and self.registry.is_newest(manifest.identity, manifest.version):
            await self._announce(identity_to_dict(manifest.identity), manifest.version)

    async def op_latest(self, msg: dict[str, Any]) -> Any:
        identity = identity_from_dict(_arg(msg, "identity", dict))
        pub = await self.registry.latest(identity, _arg(msg, "min_version", int, 0), **_filters(msg))
        if pub is None:
            return None
        return {"identity": identity_to_dict(pub.identity), "version": pub.version,
                "revisions": [m.revision for m in pub.manifests]}  # fmt: skip

    async def op_relay_join(self, msg: dict[str, Any]) -> Any:
        """Join a version's relays (with an offer, or none: a reader); the upstream's offer, or None. An offer of a
        layout held here may come compact, and the upstream's goes compact when the joiner lists its layout
        (``layouts``): a join then costs O(1) bytes and checks, not O(tensors)."""
        identity = identity_from_dict(_arg(msg, "identity", dict))
        d = _arg(msg, "offer", dict, None)
        offer: RelayOffer | None = None
        if d is not None:
            decode = partial(offer_from_dict, layouts=self._layouts)
            offer = await self._decode(d, ("params", "held"), decode)
        if offer is not None and offer.receiver != _arg(msg, "receiver_id", str):
            raise ManifestError("a relay offer names the receiver that joins with it")
        up = await self.registry.relay_join(identity, _arg(msg, "version", int), _arg(msg, "receiver_id", str),
                                            layout=_arg(msg, "layout", str, ""), offer=offer)  # fmt: skip
        if up is None:
            return None
        known = _arg(msg, "layouts", list, [])
        return offer_to_dict(up, compact=up.layout in known and up.layout in self._layouts)

    async def op_relay_leave(self, msg: dict[str, Any]) -> Any:
        identity = identity_from_dict(_arg(msg, "identity", dict))
        await self.registry.relay_leave(identity, _arg(msg, "receiver_id", str))

    async def op_manifests(self, msg: dict[str, Any]) -> Any:
        identity = identity_from_dict(_arg(msg, "identity", dict))
        version = _arg(msg, "version", int)
        pub = await self.registry.latest(identity, version, early=_arg(msg, "early", bool, False))
        if pub is None or pub.version != version:
            raise VersionError("no longer offered (superseded, released or its publisher's lease expired)",
                               version=version)  # fmt: skip
        return [self._encoded(m) for m in pub.manifests]

    def _encoded(self, manifest: Manifest) -> orjson.Fragment:
        """``manifest`` as the reply carries it, encoded once for every receiver that fetches it: an LRU of the
        last ``WIRE_CACHE`` manifests served, each entry its bytes and a weak reference to the very object it
        encoded (a manifest the store dropped is not kept alive, and an equal one is not taken for it)."""
        hit = self._wire.pop(id(manifest), None)
        if hit is None or hit[0]() is not manifest:
            hit = (weakref.ref(manifest), orjson.Fragment(encode(manifest_to_dict(manifest))))
            while len(self._wire) >= WIRE_CACHE:
                del self._wire[next(iter(self._wire))]
        self._wire[id(manifest)] = hit
        return hit[1]

    async def op_register_receiver(self, msg: dict[str, Any]) -> Any:
        identity = identity_from_dict(_arg(msg, "identity", dict))
        await self.registry.register_receiver(identity, _arg(msg, "receiver_id", str),
                                              owner=_arg(msg, "owner", str, None))  # fmt: skip

    async def op_unregister_receiver(self, msg: dict[str, Any]) -> Any:
        identity = identity_from_dict(_arg(msg, "identity", dict))
        await self.registry.unregister_receiver(identity, _arg(msg, "receiver_id", str))

    async def op_report(self, msg: dict[str, Any]) -> Any:
        identity = identity_from_dict(_arg(msg, "identity", dict))
        await self.registry.report(identity, _arg(msg, "receiver_id", str), _arg(msg, "version", int))

    async def op_is_released(self, msg: dict[str, Any]) -> Any:
        identity = identity_from_dict(_arg(msg, "identity", dict))
        policy = ReleasePolicy.from_dict(msg.get("policy"))
        return await self.registry.is_released(identity, _arg(msg, "version", int), policy=policy)

    async def op_acked(self, msg: dict[str, Any]) -> Any:
        identity = identity_from_dict(_arg(msg, "identity", dict))
        return list(await self.registry.acked(identity, _arg(msg, "version", int)))

    async def op_wait_released(self, msg: dict[str, Any]) -> Any:
        """Wait up to ``wait_s`` (at most MAX_WAIT_S); the result says whether it was released."""
        identity = identity_from_dict(_arg(msg, "identity", dict))
        policy = ReleasePolicy.from_dict(msg.get("policy"))
        wait_s = min(max(float(_arg(msg, "wait_s", (int, float))), 0.0), MAX_WAIT_S)
        try:
            await self.registry.wait_released(identity, _arg(msg, "version", int), wait_s, policy=policy)
        except RefitTimeoutError:
            return False
        return True

    async def op_near_misses(self, msg: dict[str, Any]) -> Any:
        identity = identity_from_dict(_arg(msg, "identity", dict))
        return await self.registry.near_misses(identity, _arg(msg, "min_version", int, 0))

    async def op_versions(self, msg: dict[str, Any]) -> Any:
        return await self.registry.versions(identity_from_dict(_arg(msg, "identity", dict)))

    async def op_relayed(self, msg: dict[str, Any]) -> Any:
        return await self.registry.relayed(identity_from_dict(_arg(msg, "identity", dict)))
