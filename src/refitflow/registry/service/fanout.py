"""Relays (pipelined fan-out): which receivers serve a version, and whom each reader reads it from.

A receiver refitting a version joins that version's relays with an offer (``core.fanout``) as soon as
it has a plan, long before it commits; a receiver that serves nobody joins with none. ``Relays.join``
answers every joiner with one *upstream*: among the relays of its own layout that joined before it (every
such relay, for a reader that serves nobody), the one given the fewest readers so far, the latest joined on
ties; none (the trainer) when no relay of its layout joined before it (a joiner that names no layout: any
relay). Receivers of one layout that start
together thus form a chain in join order — the trainer feeds the first, each relay the next — so the
trainer's egress stays one copy of that layout's slice however many start at once, and every relay's egress
about one. A relay of another layout is never an upstream: it holds other slices, and its plan starts at
another place (``planner.build``: a rank's read order starts at its place), so a reader would wait for what it
reads last. Upstreams only ever join earlier, so no two receivers wait on each other. A relay leaves when it
joins a later version, unregisters, or its lease expires.

Chains that stay: receivers seldom join in the same order twice, and a reader whose relay changed describes and
prepares its relayed reads again (a plan's descriptors: ≈ 3 µs each). So a reader is given the relay it read its
last version from again (``prefer``, the registry's memory of each receiver's last upstream) when that relay joined
before it and has at most one reader more than the least read relay — a relay may serve two readers, and a chain
keeps more of its links from version to version (random join orders of 8: 44 % of links kept, against 13 %).

The registry holds each relay *by geometry* (``Relay``): its layout's digest (the geometry itself — tensors
and held boxes — held once per layout: ``core.fanout.RelayLayouts``), its address, status region and the runs of
its tensors' regions: O(1) per receiver, whatever the model's size. An offer's boxes are checked against the
version's shards once per layout and version (``check_geometry``), not per receiver.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Generic, Protocol, TypeVar

from refitflow.core.errors import ManifestError
from refitflow.core.fanout import Geometry, Relay, RelayOffer, check_offer_shape
from refitflow.core.types import Manifest, Publication

__all__ = ["Relay", "Relays", "check_geometry", "check_offer"]


def check_offer(pub: Publication, offer: RelayOffer) -> None:
    """``ManifestError`` unless ``offer`` is for ``pub`` and every box it holds lies in one of ``pub``'s
    shards, in that shard's dtype."""
    check_offer_shape(offer)
    if offer.identity != pub.identity or offer.version != pub.version:
        raise ManifestError("a relay offer is for one complete version of its identity", version=offer.version)
    check_geometry(pub.manifests, (tuple((p.name, p.dtype, p.shape) for p in offer.params), offer.held),
                   offer.version)  # fmt: skip


def check_geometry(layouts: Sequence[Manifest], geometry: Geometry, version: int) -> None:
    """``ManifestError`` unless every box ``geometry`` holds lies in one of the shards of ``layouts`` (a version's
    ranks, in rank order; their digests play no part), in that shard's dtype."""
    tensors, held = geometry
    specs = {(m.rank, s.name): s for m in layouts for s in m.shards}
    for h in held:
        spec = specs.get((h.rank, h.tensor))
        if spec is None:
            raise ManifestError(f"relay offer holds a shard rank {h.rank} did not publish", tensor=h.tensor,
                                version=version)  # fmt: skip
        shape = spec.shape
        if len(h.sbox) != len(shape) or any(b > d for (_, b), d in zip(h.sbox, shape, strict=True)):
            raise ManifestError(f"relay offer: box {h.sbox} outside the shard's {shape}", tensor=h.tensor,
                                version=version)  # fmt: skip
        if tensors[h.param][1] != spec.dtype:
            raise ManifestError("relay offer: a held box in another dtype than published", tensor=h.tensor,
                                version=version)  # fmt: skip


class _Joiner(Protocol):
    @property
    def receiver(self) -> str: ...
    @property
    def layout(self) -> str: ...


T = TypeVar("T", bound=_Joiner)


class Relays(Generic[T]):
    """One version's relays in join order, and how many readers each was given."""

    def __init__(self) -> None:
        self.offers: dict[str, T] = {}
        self.readers: dict[str, int] = {}
        self.checked: set[str] = set()  # the layouts whose offers fit this version (``check_geometry``, once each)

    def join(self, receiver_id: str, layout: str, offer: T | None, prefer: str | None = None) -> T | None:
        """Record ``offer`` (if any) and return the upstream of ``receiver_id`` (None: the trainer); ``prefer``: the
        relay it read its last version from, taken again when it joined before and has at most one reader more
        than the least read one."""
        if offer is not None and receiver_id not in self.offers:
            self.offers[receiver_id] = offer
        ids = list(self.offers)
        before = ids[: ids.index(receiver_id)] if receiver_id in self.offers else ids
        if not before:
            return None
        same = [r for r in before if self.offers[r].layout == layout] if layout else before  # "": any layout
        if not same:  # a relay of another layout holds other slices, in another order: the trainer
            return None
        pick = min(reversed(same), key=lambda r: self.readers.get(r, 0))
        if prefer is not None and prefer in same and self.readers.get(prefer, 0) <= self.readers.get(pick, 0) + 1:
            pick = prefer  # its relayed reads replay (described and prepared for that relay)
        self.readers[pick] = self.readers.get(pick, 0) + 1
        return self.offers[pick]

    def leave(self, receiver_id: str) -> None:
        self.offers.pop(receiver_id, None)
        self.readers.pop(receiver_id, None)

