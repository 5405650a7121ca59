"""The embedded, in-memory registry: manifests by identity and version, receivers and their acks.

A version is discoverable once every rank of its publisher's world has published it (``model``: what is
held of one identity; two-phase publication: *laid out* before its digests are in, *complete* after).
Each rank's layout is held once (``layouts``, by the id its canonical bytes give: ``core.records``) and each
version of it as a small ``Announcement`` (its revision and digest vector); a layout is checked when it first
arrives, and across ranks once per combination of layouts (``model``), not per version.
Receivers and releases: ``releases`` (a version is released per a ``ReleasePolicy``, and dropped once released
and superseded by a newer complete version).

Leases (``leases``): a manifest or receiver registered with an ``owner`` (a remote client's id) lives as long
as that owner heartbeats; ``expire()`` drops what stale owners held, so their versions stop being
offered, and incomplete versions that no owner holds once ``limits.incomplete_ttl_s`` has passed.
``Registry`` (``embedded``) adds ``serve``, which runs a store as a ZMQ service (``service``).

Costs: a publish of a known layout is O(its digests) (the revision recomputed) plus O(log versions held); a
new layout O(its tensors), once; old versions are dropped oldest first, each once.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Collection, Mapping

import anyio
import orjson

from refitflow.core.errors import ConfigError, ManifestError, RefitTimeoutError, VersionError
from refitflow.core.fanout import RelayLayouts
from refitflow.core.records import (
    Announcement,
    RankLayout,
    RankRecord,
    check_record,
    layout_to_dict,
)
from refitflow.core.types import Identity, Manifest, Publication
from refitflow.core.wire import UNKNOWN_LAYOUT
from refitflow.registry.limits import RegistryLimits
from refitflow.registry.messages import CLAIMED
from refitflow.registry.protocol import Store
from refitflow.registry.service.leases import Key, Leases
from refitflow.registry.service.model import Found, Model, mark, newest
from refitflow.registry.service.near_misses import near_misses
from refitflow.registry.service.relay_joins import RelayJoins
from refitflow.registry.service.releases import Releasing

__all__ = ["RegistryStore", "claimed"]

def claimed(manifest: Manifest | Announcement, lease_s: float) -> VersionError:
    """A publish of a rank another live client publishes: refused (a forged or a second publisher)."""
    return VersionError(
        f"rank {manifest.rank} of {manifest.identity.model!r} {CLAIMED}: one publisher per rank; the other must "
        f"close (or stop heartbeating for {lease_s} s) first",
        version=manifest.version,
    )


def publication(found: Found) -> Publication:
    """The whole publication of a version found (each rank's manifest made on first use)."""
    identity, version, entries = found
    return Publication(identity=identity, version=version, manifests=tuple(e.manifest for e in entries))


_EMPTY = Model()  # what a query about an unknown identity sees (queries never create models)


class RegistryStore(Releasing, RelayJoins, Store):
    """In one process. All methods are coroutines, as they are on a remote registry client."""

    announces = False  # the service announces what is published through it

    def __init__(
        self,
        *,
        lease_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        limits: RegistryLimits | None = None,
    ) -> None:
        if not lease_s > 0:
            raise ConfigError(f"lease_s must be a positive number of seconds, got {lease_s!r}")
        self.lease_s = lease_s
        self.limits = limits or RegistryLimits()
        self._clock = clock
        self._models: dict[Identity, Model] = {}
        self._layouts: dict[str, tuple[RankLayout, float]] = {}  # id -> the layout, when last announced
        self._relay_layouts = RelayLayouts(size=1024)  # relay geometries and addresses (``relay_joins``)
        self._changed = anyio.Event()
        self._leases = Leases()
        self._hold_until = float("-inf")

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    def _model(self, identity: Identity) -> Model:
        return self._models.setdefault(identity, Model())

    def _peek(self, identity: Identity) -> Model:
        return self._models.get(identity, _EMPTY)

    # -- for a replicated store's mirror (``etcd.store``): what it reads, and what it applies ------------

    def model(self, identity: Identity) -> Model:
        """What is held of exactly ``identity`` (read only; an empty model for an unknown identity)."""
        return self._peek(identity)

    @property
    def models(self) -> Mapping[Identity, Model]:
        return self._models

    def now(self) -> float:
        return self._clock()

    def withdraw(self, identity: Identity, version: int, rank: int) -> None:
        """Drop one rank's manifest (its lease ran out elsewhere): the version is incomplete again, or gone."""
        model = self._peek(identity)
        if rank in model.versions.get(version, {}):
            model.drop_rank(version, rank)
            self._notify()

    def reset(self) -> None:
        """Forget everything (a mirror about to be loaded again); waiters wake and ask again."""
        self._models.clear()
        self._layouts.clear()
        self._notify()

    def _own(self, owner: str | None, key: Key) -> None:
        if owner is not None:
            self._leases.own(owner, key, self._clock(), self._gone)

    @property
    def _owned(self) -> dict[str, set[Key]]:
        """What each owner holds (``leases.Leases.owned``)."""
        return self._leases.owned

    def _gone(self, key: Key) -> bool:
        """A version an owner held was dropped since (receivers go when unregistered or expired)."""
        return isinstance(key[1], int) and key[1] not in self._peek(key[0]).versions

    # -- layouts --------------------------------------------------------------------------------------

    def layout(self, layout_id: str) -> RankLayout | None:
        """The layout of that id, if held (checked when it was added)."""
        held = self._layouts.get(layout_id)
        return None if held is None else held[0]

    async def add_layout(self, layout: RankLayout) -> RankLayout:
        """Hold ``layout`` (checked: ``core.records.layout_from_dict``); the one held already under its id."""
        return self.hold_layout(layout)

    def hold_layout(self, layout: RankLayout) -> RankLayout:
        held = self._layouts.get(layout.id)
        layout = layout if held is None else held[0]
        self._layouts[layout.id] = (layout, self._clock())
        return layout

    def layout_of(self, manifest: Manifest) -> RankLayout:
        """``manifest``'s layout (a manifest checked whole): the one held under its id, or a new one."""
        encoded = orjson.dumps(layout_to_dict(manifest))
        held = self.layout(hashlib.blake2b(encoded, digest_size=16).hexdigest())
        return held or self.hold_layout(RankLayout.of_checked(manifest, encoded))

    # -- publishing ------------------------------------------------------------------------------------

    async def publish(self, manifest: Manifest, *, owner: str | None = None) -> None:
        """Record one rank's manifest; republishing a version with other content is refused.

        Two-phase: a pending manifest (no digest values yet) is completed by the same manifest with its
        digests; the version is *laid out* once every rank announced it, *complete* once every rank's
        digests are in. A pending manifest after the complete one changes nothing (a late retry)."""
        layout = self.layout_of(manifest)
        entry = Announcement(layout, manifest.version, manifest.revision, None, manifest=manifest)
        await self.publish_entry(entry, owner=owner)

    def entry_of(self, record: RankRecord) -> Announcement:
        """``record`` as an entry of the layout it names: checked against it (its size, its revision; CPU work
        of O(digests), which the service does in a worker thread); ``ManifestError`` for a layout not held."""
        layout = self.layout(record.layout)
        if layout is None:
            raise ManifestError(f"{UNKNOWN_LAYOUT} ({record.layout[:12]}): send the rank's layout",
                                version=record.version)  # fmt: skip
        return Announcement.of_record(layout, record, check_record(layout, record))

    async def publish_entry(self, entry: Announcement, *, owner: str | None = None) -> None:
        """Record one rank's announcement (``publish``, with its layout held and its record checked)."""
        if self.admit(entry, owner=owner):
            self.record(entry, owner=owner)

    def admit(self, entry: Announcement, *, owner: str | None = None) -> bool:
        """Raise if ``entry`` is refused here; False when it changes nothing (a late retry)."""
        model = self._peek(entry.identity)
        version, rank = entry.version, entry.rank
        holder = self._leases.holder(entry.identity, rank)
        if owner is not None and holder not in (None, owner):
            raise claimed(entry, self.lease_s)
        known = model.versions.get(version, {})
        old = known.get(rank)
        if old is not None and (entry.pending or old.pending):
            if entry.pending and not old.pending and old.layout is entry.layout:
                return False  # the pending announcement again, after its digests: a late retry
            again = entry.pending and old.pending and old.same_geometry(entry)  # a retry (or a new address)
            if not (again or (old.pending and old.layout is entry.layout)):
                raise VersionError(f"rank {rank} already announced this version with another layout", version=version)
        elif old is not None and old.revision != entry.revision:
            raise VersionError(f"rank {rank} already published this version with other content", version=version)
        if old is None:
            ahead = self.limits.max_version_ahead
            if not known and ahead is not None:
                self._check_ahead(model, version, ahead)
            model.check_rank(version, entry.layout)
        return True

    @staticmethod
    def _check_ahead(model: Model, version: int, ahead: int) -> None:
        """Refuse a new version far above the newest complete one or, with none (a fresh identity, a registry
        that restarted), above the newest any registered receiver says it committed (re-sent on return)."""
        newest = model.newest
        if newest is not None:
            if version > newest + ahead:
                raise VersionError(f"more than {ahead} versions above the newest complete version {newest}",
                                   version=version)  # fmt: skip
            return
        done = max(model.receivers.values(), default=-1)  # only without a complete version: O(receivers)
        if done >= 0 and version > done + ahead:
            raise VersionError(f"more than {ahead} versions above {done}, the newest version a receiver of this "
                               "model says it committed", version=version)  # fmt: skip

    def record(self, entry: Announcement, *, owner: str | None = None) -> None:
        """Hold ``entry`` (``admit`` said yes; a replicated store's mirror applies what was admitted)."""
        model = self._model(entry.identity)
        version, rank = entry.version, entry.rank
        self.hold_layout(entry.layout)
        ranks = model.versions.get(version)
        if ranks is None:
            ranks = model.versions[version] = {}
            model.first_seen[version] = self._clock()
            mark(model.order, version)
        new = rank not in ranks
        ranks[rank] = entry  # the same content again: its newest source address wins
        if new:
            model.add_rank(version, entry)
        if owner is not None:
            model.owner[(version, rank)] = owner
            self._leases.claim(entry.identity, rank, owner)
        if len(ranks) == entry.world_size:
            mark(model.laid_out, version)
            if version not in model.completed_at and not any(e.pending for e in ranks.values()):
                model.completed_at[version] = self._clock()
                mark(model.complete, version)
        self._own(owner, (entry.identity, version, rank))
        self._collect(model)
        self._notify()

    # -- reads ---------------------------------------------------------------------------------------

    def announced(self, identity: Identity, version: int, rank: int) -> Manifest | None:
        """The manifest ``rank`` announced for ``version`` (pending or complete), if held."""
        entry = self.entry(identity, version, rank)
        return None if entry is None else entry.manifest

    def entry(self, identity: Identity, version: int, rank: int) -> Announcement | None:
        """What ``rank`` announced for ``version`` (pending or complete), if held."""
        return self._peek(identity).versions.get(version, {}).get(rank)

    def newest_complete(self, identity: Identity) -> int | None:
        """The newest complete version held for exactly ``identity`` (no filters), or None."""
        return self._peek(identity).newest

    def is_newest(self, identity: Identity, version: int) -> bool:
        """``version`` is the newest complete or the newest laid-out version of exactly ``identity``."""
        model = self._peek(identity)
        return version in (model.newest, model.laid_out[-1] if model.laid_out else None)

    def find(
        self, identity: Identity, min_version: int = 0, *, compile_targets: Collection[str] | None = None,
        metadata: Mapping[str, str] | None = None, early: bool = False, skip: Collection[int] = (),
    ) -> Found | None:  # fmt: skip
        """As ``latest``, without making any manifest: the version's entries."""
        return newest(self._models, identity, min_version, compile_targets, metadata, early, skip)

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
        """The newest complete version ≥ ``min_version``, or None (``Discovery.latest``)."""
        found = newest(self._models, identity, min_version, compile_targets, metadata, early, skip)
        return None if found is None else publication(found)

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
        """The newest complete version ≥ ``min_version``, waiting up to ``timeout`` seconds for one
        (``early``, ``skip``: as ``latest``)."""
        with anyio.move_on_after(timeout):
            while True:
                changed = self._changed
                found = newest(self._models, identity, min_version, compile_targets, metadata, early, skip)
                if found is not None:
                    return publication(found)
                await changed.wait()
        raise RefitTimeoutError(f"no complete version ≥ {min_version} of {identity.model!r} within {timeout} s")

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
        """``wait_complete``: in this process the manifests are whole, a receiver takes its part of them itself."""
        return await self.wait_complete(identity, min_version, timeout, compile_targets=compile_targets,
                                        metadata=metadata, early=early, skip=skip)  # fmt: skip

    async def versions(self, identity: Identity) -> list[int]:
        """The versions held (complete or not), oldest first."""
        return list(self._peek(identity).order)

    async def near_misses(self, identity: Identity, min_version: int = 0) -> list[str]:
        """What this registry holds of ``identity.model`` that does not match (for a discovery timeout)."""
        return near_misses({i: m.versions for i, m in self._models.items()}, identity, min_version)

    async def goodbye(self, owner: str) -> None:
        """``owner`` closed: the ranks it published may be published by another client at once (what it
        published stays until its lease runs out, for receivers reading it)."""
        self._leases.goodbye(owner)

    async def heartbeat(self, owner: str) -> bool:
        """Extend ``owner``'s lease; False when the registry did not know it (restarted or expired)."""
        return self._leases.heartbeat(owner, self._clock())

    def extend_leases(self, seconds: float) -> None:
        """Every lease lives ``seconds`` longer (the registry could not read heartbeats for that long)."""
        self._leases.extend(seconds)

    def expire(self) -> list[str]:
        """Drop every owner whose lease ran out, with the manifests and receivers it held, and every
        incomplete version no owner holds once ``limits.incomplete_ttl_s`` has passed since it appeared."""
        now = self._clock()
        stale = self._leases.stale(now, self.lease_s)
        for owner, owned in stale.items():
            for identity, key, rank in owned:
                model = self._peek(identity)
                if isinstance(key, str):
                    model.receivers.pop(key, None)
                    model.upstream.pop(key, None)
                    self._drop_relays(model, key)
                elif model.owner.get((key, rank)) == owner:
                    model.drop_rank(key, rank)
        dropped = 0
        for model in self._models.values():
            for version in [v for v, t in model.first_seen.items() if now - t > self.limits.incomplete_ttl_s]:
                ranks = model.versions[version]
                if version not in model.completed_at and not any((version, r) in model.owner for r in ranks):
                    model.drop(version)
                    dropped += 1
            dropped += self._collect(model)  # also what a hold on releases kept
        self.prune_layouts(now)
        if stale or dropped:
            self._notify()
        return list(stale)

    def prune_layouts(self, now: float) -> set[str]:
        """Forget layouts no version held announces, unless announced within ``limits.incomplete_ttl_s``; their ids."""
        used = {e.layout.id for m in self._models.values() for ranks in m.versions.values() for e in ranks.values()}
        ttl = self.limits.incomplete_ttl_s
        gone = {k for k, v in self._layouts.items() if k not in used and now - v[1] > ttl}
        for k in gone:
            del self._layouts[k]
        return gone
