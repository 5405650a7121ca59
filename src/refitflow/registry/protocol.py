"""The registry's interface, in one place: what the in-memory store, the etcd store and the remote client each
implement, cut by who calls it.

- ``Publishing``: what a publisher asks — announce a rank's manifest, learn when receivers are done with a
  version (``api.publisher``; a test's stand-in may implement this alone).
- ``RelayRegistry``: joining and leaving a version's relays (pipelined fan-out, ``registry.service.fanout``).
- ``Discovery``: what a receiver asks — find versions, say it is there and what it is done with, relays.
- ``RegistryProtocol``: all of the above and what else a client may ask (``versions``, ``relayed``): the face of
  ``rf.Registry`` and ``rf.RegistryClient`` alike.
- ``Store``: what the registry service serves (``registry.service``): the same, with owners (a remote client's
  lease) on the writes, and the lease and announcement hooks the service drives.

The stores subclass ``Store`` and the client ``RegistryProtocol`` explicitly, so mypy holds each to these
signatures; the client's plain requests take theirs from here (``registry.client.calls``).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Protocol

from refitflow.core.fanout import Geometry, Relay, RelayOffer
from refitflow.core.records import Announcement, RankLayout, RankRecord
from refitflow.core.types import Identity, Manifest, Publication, SourceAddress
from refitflow.registry.limits import RegistryLimits
from refitflow.registry.release import ReleasePolicy

__all__ = ["Discovery", "Found", "Publishing", "RegistryProtocol", "RelayRegistry", "Store"]

Found = tuple[Identity, int, tuple[Announcement, ...]]  # a version found: identity, number, ranks in rank order


class Publishing(Protocol):
    async def publish(self, manifest: Manifest) -> None:
        """Announce one rank's manifest of one version (pending: its layout before its digests)."""
        ...

    async def is_released(self, identity: Identity, version: int, *, policy: ReleasePolicy | None = None) -> bool:
        """Whether ``version`` is released per ``policy`` (default: every registered receiver is done with it)."""
        ...

    async def acked(self, identity: Identity, version: int) -> tuple[int, int]:
        """(receivers done with ``version``, receivers registered)."""
        ...

    async def wait_released(
        self, identity: Identity, version: int, timeout: float | None, *, policy: ReleasePolicy | None = None
    ) -> None:
        """Return once ``version`` is released per ``policy``; ``RefitTimeoutError`` after ``timeout``."""
        ...


class RelayRegistry(Protocol):
    async def relay_join(
        self, identity: Identity, version: int, receiver_id: str, *, layout: str = "", offer: RelayOffer | None = None,
        keep: int | None = None,
    ) -> RelayOffer | None:
        """Join ``version``'s relays with ``offer`` (None: a reader that serves nobody); the upstream to read
        from (None: the trainer). Leaves every other version's relays but ``keep``'s: a version the receiver
        still serves from a storage this refit leaves alone (a shadow relay that swaps storages)."""
        ...

    async def relay_leave(self, identity: Identity, receiver_id: str) -> None:
        """``receiver_id`` serves no version any more (it is about to change its bytes, or leaving)."""
        ...


class Discovery(RelayRegistry, Protocol):
    async def latest(
        self,
        identity: Identity,
        min_version: int = 0,
        *,
        compile_targets: Collection[str] | None = None,
        metadata: Mapping[str, str] | None = None,
        early: bool = False,
        skip: Collection[int] = (),
    ) -> Publication | None:
        """The newest complete version ≥ ``min_version``, or None.

        ``compile_targets``: accept any of these compile targets instead of ``identity.compile_target``;
        ``metadata``: only versions whose every manifest's metadata contains these items; ``early``: also
        versions laid out but not complete (some rank's digests pending: ``Publication.pending``); ``skip``:
        versions the asker cannot use (their sources unreadable to it), passed over for older ones."""
        ...

    async def wait_complete(
        self,
        identity: Identity,
        min_version: int,
        timeout: float,
        *,
        compile_targets: Collection[str] | None = None,
        metadata: Mapping[str, str] | None = None,
        early: bool = False,
        skip: Collection[int] = (),
    ) -> Publication:
        """As ``latest``, waiting up to ``timeout`` seconds for one (``RefitTimeoutError`` then)."""
        ...

    async def wait_outline(
        self,
        identity: Identity,
        min_version: int,
        timeout: float,
        *,
        compile_targets: Collection[str] | None = None,
        metadata: Mapping[str, str] | None = None,
        early: bool = False,
        skip: Collection[int] = (),
    ) -> Publication:
        """As ``wait_complete``, the version as a receiver plans and reads it: a registry across a network answers
        an ``core.records.Outline`` (every rank's layout, fetched once each; a plan's part of the digests fetched
        alone, ``Outline.digests``), a registry in this process the whole publication."""
        ...

    async def near_misses(self, identity: Identity, min_version: int = 0) -> list[str]:
        """What is held of ``identity.model`` that does not match, in sentences (for a discovery timeout)."""
        ...

    async def register_receiver(self, identity: Identity, receiver_id: str) -> None:
        """A receiver that releases hold back until it reports them (``report``)."""
        ...

    async def unregister_receiver(self, identity: Identity, receiver_id: str) -> None: ...

    async def report(self, identity: Identity, receiver_id: str, version: int) -> None:
        """``receiver_id`` is done with ``version`` (committed, aborted or moved past it), and every older one."""
        ...


class RegistryProtocol(Publishing, Discovery, Protocol):
    async def versions(self, identity: Identity) -> list[int]:
        """The versions held (complete or not), oldest first."""
        ...

    async def relayed(self, identity: Identity) -> int | None:
        """The newest complete version some receiver relays, or None: what a receiver joining a running fleet
        reads from its peers rather than from the trainer."""
        ...


class Store(RegistryProtocol, Protocol):
    lease_s: float
    limits: RegistryLimits
    announces: bool  # True: the store announces complete versions itself (etcd: from its watch)

    async def publish(self, manifest: Manifest, *, owner: str | None = None) -> None:
        """As ``Publishing.publish``; ``owner`` (a remote client): the rank is that client's while its lease lives."""
        ...

    async def register_receiver(self, identity: Identity, receiver_id: str, *, owner: str | None = None) -> None: ...

    def is_newest(self, identity: Identity, version: int) -> bool:
        """``version`` is the newest complete or the newest laid-out version of exactly ``identity``."""
        ...

    def announced(self, identity: Identity, version: int, rank: int) -> Manifest | None:
        """The manifest ``rank`` announced for ``version`` (pending or complete), if held."""
        ...

    async def heartbeat(self, owner: str) -> bool:
        """Extend ``owner``'s lease; False when the store did not know it (restarted or expired)."""
        ...

    async def goodbye(self, owner: str) -> None:
        """``owner`` closed: the ranks it published may be published by another client at once."""
        ...

    def hold_releases(self, seconds: float) -> None:
        """For ``seconds``, "every registered receiver is done" releases nothing (a restarted registry)."""
        ...

    def expire(self) -> list[str]:
        """Drop what owners whose lease ran out held; the owners dropped."""
        ...

    def extend_leases(self, seconds: float) -> None:
        """Every lease lives ``seconds`` longer (the service could not read heartbeats for that long)."""
        ...

    # -- by layout and record (``core.records``): what the service takes and serves without whole manifests --

    def layout(self, layout_id: str) -> RankLayout | None:
        """The rank layout of that id, if held (checked when it was added)."""
        ...

    async def add_layout(self, layout: RankLayout) -> RankLayout:
        """Hold a checked rank layout (once: the one held under its id is returned)."""
        ...

    def entry_of(self, record: RankRecord) -> Announcement:
        """``record`` checked against the layout it names (size, revision: O(digests) of CPU);
        ``ManifestError`` saying ``UNKNOWN_LAYOUT`` for a layout not held."""
        ...

    async def publish_entry(self, entry: Announcement, *, owner: str | None = None) -> None:
        """As ``publish``, for an announcement of a layout held."""
        ...

    def entry(self, identity: Identity, version: int, rank: int) -> Announcement | None:
        """What ``rank`` announced for ``version`` (pending or complete), if held."""
        ...

    def find(
        self, identity: Identity, min_version: int = 0, *, compile_targets: Collection[str] | None = None,
        metadata: Mapping[str, str] | None = None, early: bool = False, skip: Collection[int] = (),
    ) -> Found | None:  # fmt: skip
        """As ``latest``, without making any manifest: the version's announcements."""
        ...

    # -- relays by geometry (``core.fanout.Relay``) --------------------------------------------------------

    def relay_geometry(self, layout: str) -> Geometry | None: ...

    async def add_relay_geometry(self, layout: str, geometry: Geometry) -> None:
        """Hold a relay layout's geometry (its digest computed by the caller from a whole offer it checked)."""
        ...

    def relay_source(self, sid: str) -> SourceAddress | None: ...

    async def add_relay_source(self, source: SourceAddress) -> None: ...

    async def join_relays(
        self, identity: Identity, version: int, receiver_id: str, layout: str, relay: Relay | None,
        keep: int | None = None,
    ) -> Relay | None:
        """``relay_join`` by geometry: O(1) in the model's size."""
        ...

    def offer_of(self, identity: Identity, version: int, relay: Relay) -> RelayOffer:
        """A relay's whole offer (O(tensors): for a peer that does not hold its geometry)."""
        ...
