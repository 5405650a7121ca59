"""Joining a version's relays, in the in-memory store (``RegistryStore``'s half that schedules fan-out).

The store holds each relay by geometry (``core.fanout.Relay``): the geometry itself once per layout digest and
each address once per id (``RelayLayouts``), and per receiver only its layout, address, status region and
regions as runs — O(1) per join, whatever the model's size. ``relay_join`` (the protocol's: whole offers in,
the upstream's whole offer out) is the in-process face; the service joins by geometry (``join_relays``) and
answers compactly. An offer's boxes are checked against the version's shards once per layout and version.
"""

from __future__ import annotations

from collections.abc import Callable

from refitflow.core.errors import ManifestError, VersionError
from refitflow.core.fanout import Geometry, Relay, RelayLayouts, RelayOffer, check_offer_shape, expand_runs
from refitflow.core.types import Identity, SourceAddress
from refitflow.core.wire import UNKNOWN_LAYOUT
from refitflow.registry.protocol import Store
from refitflow.registry.service.fanout import Relays, check_geometry
from refitflow.registry.service.model import Model

__all__ = ["RelayJoins", "join_whole"]


async def join_whole(
    store: Store, identity: Identity, version: int, receiver_id: str, layout: str, offer: RelayOffer | None,
    keep: int | None = None,
) -> RelayOffer | None:
    """``relay_join`` as the protocol has it — a whole offer in, the upstream's whole offer out — by geometry."""
    relay = None
    if offer is not None:
        if offer.identity != identity or offer.version != version:
            raise ManifestError("a relay offer is for one complete version of its identity", version=version)
        if store.relay_geometry(offer.layout) is None:
            check_offer_shape(offer)
            await store.add_relay_geometry(offer.layout, (tuple((p.name, p.dtype, p.shape) for p in offer.params),
                                                          offer.held))  # fmt: skip
        await store.add_relay_source(offer.source)
        relay = Relay.of(offer)
    up = await store.join_relays(identity, version, receiver_id, layout, relay, keep)
    return None if up is None else store.offer_of(identity, version, up)


class RelayJoins:
    """Set up by ``RegistryStore``: its models and the relay geometries and addresses it holds."""

    _relay_layouts: RelayLayouts
    _model: Callable[[Identity], Model]
    _peek: Callable[[Identity], Model]

    def relay_geometry(self, layout: str) -> Geometry | None:
        return self._relay_layouts.geometry(layout)

    async def add_relay_geometry(self, layout: str, geometry: Geometry) -> None:
        """Hold a relay layout's geometry (its digest computed by the caller from a whole offer it checked)."""
        self._relay_layouts.add_geometry(layout, geometry)

    def relay_source(self, sid: str) -> SourceAddress | None:
        return self._relay_layouts.source(sid)

    async def add_relay_source(self, source: SourceAddress) -> None:
        self._relay_layouts.add_source(source)

    async def relay_join(
        self, identity: Identity, version: int, receiver_id: str, *, layout: str = "", offer: RelayOffer | None = None,
        keep: int | None = None,
    ) -> RelayOffer | None:
        """Join ``version``'s relays with ``offer`` (None: a reader that serves nobody); the upstream to read
        from (None: the trainer). Leaves every other version's relays but ``keep``'s (``registry.relays``)."""
        return await join_whole(self, identity, version, receiver_id, layout, offer, keep)  # type: ignore[arg-type]

    def offer_of(self, identity: Identity, version: int, relay: Relay) -> RelayOffer:
        """The whole offer of ``relay`` (the one it was made of, in this process; else made from its geometry)."""
        if relay.offer is not None:
            return relay.offer
        known = self._relay_layouts.params(relay.layout, expand_runs(relay.regions))
        if known is None:
            raise ManifestError(f"relay: {UNKNOWN_LAYOUT} ({relay.layout:.32})", version=version)
        params, held = known
        return RelayOffer(identity=identity, version=version, receiver=relay.receiver, source=relay.source,
                          status=relay.status, params=params, held=held, layout=relay.layout)  # fmt: skip

    async def join_relays(
        self, identity: Identity, version: int, receiver_id: str, layout: str, relay: Relay | None,
        keep: int | None = None,
    ) -> Relay | None:
        """Join ``version``'s relays by geometry; the upstream (None: the trainer). The receiver's offer of ``keep``
        (if it made one) stays: it still serves that version from a storage this refit leaves alone."""
        self.check_relay(identity, version, relay)
        model = self._model(identity)
        for v, relays in model.relays.items():
            if v not in (version, keep):
                relays.leave(receiver_id)
        relays = model.relays.setdefault(version, Relays())
        if relay is not None:
            relays.checked.add(relay.layout)
        up = relays.join(receiver_id, layout, relay, prefer=model.upstream.get(receiver_id))
        if up is not None:
            model.upstream[receiver_id] = up.receiver
        return up

    def check_relay(self, identity: Identity, version: int, relay: Relay | None) -> None:
        """Raise unless ``version`` is complete and still held, and ``relay`` (if any) fits its shards."""
        model = self._peek(identity)
        ranks = model.versions.get(version)
        if ranks is None or version not in model.completed_at:  # complete, still held (newer ones may exist)
            raise VersionError("relays need their version complete and still offered", version=version)
        relays = model.relays.get(version)
        if relay is not None and (relays is None or relay.layout not in relays.checked):  # once per layout
            geometry = self.relay_geometry(relay.layout)
            if geometry is None:
                raise ManifestError(f"relay offer: {UNKNOWN_LAYOUT} ({relay.layout:.32})", version=version)
            check_geometry([ranks[r].layout.manifest for r in range(len(ranks))], geometry, version)

    async def relay_leave(self, identity: Identity, receiver_id: str) -> None:
        """``receiver_id`` serves no version any more (it is about to change its bytes, or leaving)."""
        self._drop_relays(self._peek(identity), receiver_id)

    def _drop_relays(self, model: Model, receiver_id: str) -> None:
        for relays in model.relays.values():
            relays.leave(receiver_id)

    async def relayed(self, identity: Identity) -> int | None:
        """The newest complete version some receiver relays (offers to its peers), or None: what a receiver
        joining a running fleet reads from its peers rather than the trainer."""
        model = self._peek(identity)
        held = [v for v, relays in model.relays.items() if relays.offers and v in model.completed_at]
        return max(held, default=None)
