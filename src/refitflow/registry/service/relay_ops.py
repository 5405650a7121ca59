"""Relay joins over the service, by geometry (``core.offers``): O(1) in the model's size once each geometry and
address is held.

A compact offer names a layout (and maybe an address) the registry holds; one that names what it does not hold is
refused with ``UNKNOWN_LAYOUT`` and sent whole, once per geometry. The upstream comes back compact when the
joiner lists its layout (``layouts``: the few it knows), its address as an id when the joiner lists that
(``sources``).
"""

from __future__ import annotations

from typing import Any

import anyio

from refitflow.core.errors import ManifestError
from refitflow.core.fanout import Relay, RelayLayouts, source_id
from refitflow.core.offers import offer_from_dict, offer_to_dict, relay_from_dict, relay_to_dict
from refitflow.registry.messages import identity_from_dict
from refitflow.registry.protocol import Store
from refitflow.registry.service.args import OFF_LOOP_SHARDS, arg, off_loop_if, rows

__all__ = ["RelayOps"]


class _Known(RelayLayouts):
    """The store's geometries and addresses as a ``RelayLayouts`` (what the wire form reads compact offers by)."""

    def __init__(self, store: Store) -> None:
        super().__init__()
        self.store = store

    def geometry(self, layout: str) -> Any:
        return self.store.relay_geometry(layout)

    def source(self, sid: str) -> Any:
        return self.store.relay_source(sid)


class RelayOps:
    registry: Store
    _checking: anyio.CapacityLimiter

    async def op_relay_join(self, msg: dict[str, Any]) -> Any:
        """Join a version's relays (with an offer, or none: a reader); the upstream's offer, or None."""
        identity = identity_from_dict(arg(msg, "identity", dict))
        version, receiver_id = arg(msg, "version", int), arg(msg, "receiver_id", str)
        layouts, sources = set(map(str, arg(msg, "layouts", list, []))), set(map(str, arg(msg, "sources", list, [])))
        d = arg(msg, "offer", dict, None)
        relay: Relay | None = None
        if d is not None:
            known = _Known(self.registry)
            if "layout" in d:
                ident, at, relay = relay_from_dict(d, known)
            else:
                count = sum(rows(d.get(k)) for k in ("params", "held"))
                if count > self.registry.limits.max_shards:
                    raise ManifestError(f"{count} rows in one relay offer, over the registry's limit of "
                                        f"{self.registry.limits.max_shards}")  # fmt: skip
                offer = await off_loop_if(count > OFF_LOOP_SHARDS, self._checking, offer_from_dict, d, known)
                ident, at, relay = offer.identity, offer.version, Relay.of(offer)
                geometry = (tuple((p.name, p.dtype, p.shape) for p in offer.params), offer.held)
                await self.registry.add_relay_geometry(offer.layout, geometry)
                relay = Relay(relay.receiver, relay.layout, relay.source, relay.status, relay.regions)  # by geometry
            if ident != identity or at != version:
                raise ManifestError("a relay offer is for the version it joins", version=version)
            if relay.receiver != receiver_id:
                raise ManifestError("a relay offer names the receiver that joins with it")
            await self.registry.add_relay_source(relay.source)
        keep = arg(msg, "keep", int, None)
        up = await self.registry.join_relays(identity, version, receiver_id, arg(msg, "layout", str, ""), relay, keep)
        if up is None:
            return None
        source_known = source_id(up.source) in sources
        if up.layout in layouts:
            return relay_to_dict(identity, version, up, source_known=source_known)
        whole = self.registry.offer_of(identity, version, up)
        return await off_loop_if(len(whole.params) > OFF_LOOP_SHARDS, self._checking, _whole, whole, source_known)

    async def op_relay_leave(self, msg: dict[str, Any]) -> Any:
        identity = identity_from_dict(arg(msg, "identity", dict))
        await self.registry.relay_leave(identity, arg(msg, "receiver_id", str))

    async def op_relayed(self, msg: dict[str, Any]) -> Any:
        return await self.registry.relayed(identity_from_dict(arg(msg, "identity", dict)))


def _whole(offer: Any, source_known: bool) -> dict[str, Any]:
    return offer_to_dict(offer, source_known=source_known)
