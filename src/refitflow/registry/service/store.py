"""The embedded, in-memory registry: manifests by identity and version, receivers and their acks.

A version is discoverable once every rank of its publisher's world has published it (``model``: what is
held of one identity; two-phase publication: *laid out* before its digests are in, *complete* after).
Receivers and releases: ``releases`` (a version is released per a ``ReleasePolicy``, and dropped once released
and superseded by a newer complete version).

Leases (``leases``): a manifest or receiver registered with an ``owner`` (a remote client's id) lives as long
as that owner heartbeats; ``expire()`` drops what stale owners held, so their versions stop being
offered, and incomplete versions that no owner holds once ``limits.incomplete_ttl_s`` has passed.
``Registry`` (``embedded``) adds ``serve``, which runs a store as a ZMQ service (``service``).

Costs: a publish is O(tensors of the manifest) plus O(log versions held); old versions are dropped
oldest first, each once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping

import anyio

from refitflow.core.errors import ConfigError, RefitTimeoutError, VersionError
from refitflow.core.fanout import RelayOffer
from refitflow.core.types import Identity, Manifest, Publication
from refitflow.registry.limits import RegistryLimits
from refitflow.registry.messages import CLAIMED
from refitflow.registry.protocol import Store
from refitflow.registry.service.checks import VersionIndex
from refitflow.registry.service.fanout import Relays, check_offer
from refitflow.registry.service.leases import Key, Leases
from refitflow.registry.service.model import Model, mark, newest
from refitflow.registry.service.near_misses import near_misses
from refitflow.registry.service.releases import Releasing

__all__ = ["RegistryStore", "claimed"]

def claimed(manifest: Manifest, lease_s: float) -> VersionError:
    """A publish of a rank another live client publishes: refused (a forged or a second publisher)."""
    return VersionError(
        f"rank {manifest.rank} of {manifest.identity.model!r} {CLAIMED}: one publisher per rank; the other must "
        f"close (or stop heartbeating for {lease_s} s) first",
        version=manifest.version,
    )


_EMPTY = Model()  # what a query about an unknown identity sees (queries never create models)


class RegistryStore(Releasing, Store):
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

    async def publish(self, manifest: Manifest, *, owner: str | None = None) -> None:
        """Record one rank's manifest; republishing a version with other content is refused.

        Two-phase: a pending manifest (no digest values yet) is completed by the same manifest with its
        digests; the version is *laid out* once every rank announced it, *complete* once every rank's
        digests are in. A pending manifest after the complete one changes nothing (a late retry)."""
        if self.admit(manifest, owner=owner):
            self.record(manifest, owner=owner)

    def admit(self, manifest: Manifest, *, owner: str | None = None) -> bool:
        """Raise if ``manifest`` is refused here; False when it changes nothing (a late retry)."""
        model = self._peek(manifest.identity)
        version, rank = manifest.version, manifest.rank
        holder = self._leases.holder(manifest.identity, rank)
        if owner is not None and holder not in (None, owner):
            raise claimed(manifest, self.lease_s)
        known = model.versions.get(version, {})
        old = known.get(rank)
        if old is not None and (manifest.pending or old.pending):
            if manifest.pending and not old.pending and old.completes(manifest):
                return False  # the pending announcement again, after its digests: a late retry
            again = manifest.pending and old.pending and old.shards == manifest.shards  # a retry (or a new address)
            if not (again or manifest.completes(old)):
                raise VersionError(f"rank {rank} already announced this version with another layout", version=version)
        elif old is not None and old.revision != manifest.revision:
            raise VersionError(f"rank {rank} already published this version with other content", version=version)
        if old is None:
            ahead = self.limits.max_version_ahead
            if not known and ahead is not None:
                self._check_ahead(model, version, ahead)
            (model.index.get(version) or VersionIndex()).check(manifest)
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

    def record(self, manifest: Manifest, *, owner: str | None = None) -> None:
        """Hold ``manifest`` (``admit`` said yes; a replicated store's mirror applies what was admitted)."""
        model = self._model(manifest.identity)
        version, rank = manifest.version, manifest.rank
        known = model.versions.get(version, {})
        if rank not in known:
            index = model.index.get(version) or VersionIndex()
            index.add(manifest)
            if not known:
                model.versions[version], model.index[version] = known, index
                model.first_seen[version] = self._clock()
                mark(model.order, version)
        ranks = known
        ranks[rank] = manifest  # the same content again: its newest source address wins
        if owner is not None:
            model.owner[(version, rank)] = owner
            self._leases.claim(manifest.identity, rank, owner)
        if len(ranks) == manifest.world_size:
            mark(model.laid_out, version)
            if version not in model.completed_at and not any(m.pending for m in ranks.values()):
                model.completed_at[version] = self._clock()
                mark(model.complete, version)
        self._own(owner, (manifest.identity, version, rank))
        self._collect(model)
        self._notify()

    def announced(self, identity: Identity, version: int, rank: int) -> Manifest | None:
        """The manifest ``rank`` announced for ``version`` (pending or complete), if held."""
        return self._peek(identity).versions.get(version, {}).get(rank)

    def newest_complete(self, identity: Identity) -> int | None:
        """The newest complete version held for exactly ``identity`` (no filters), or None."""
        return self._peek(identity).newest

    def is_newest(self, identity: Identity, version: int) -> bool:
        """``version`` is the newest complete or the newest laid-out version of exactly ``identity``."""
        model = self._peek(identity)
        return version in (model.newest, model.laid_out[-1] if model.laid_out else None)

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
        return newest(self._models, identity, min_version, compile_targets, metadata, early, skip)

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
                pub = newest(self._models, identity, min_version, compile_targets, metadata, early, skip)
                if pub is not None:
                    return pub
                await changed.wait()
        raise RefitTimeoutError(f"no complete version ≥ {min_version} of {identity.model!r} within {timeout} s")

    async def relay_join(
        self, identity: Identity, version: int, receiver_id: str, *, layout: str = "", offer: RelayOffer | None = None
    ) -> RelayOffer | None:
        """Join ``version``'s relays with ``offer`` (None: a reader that serves nobody); the upstream to read
        from (None: the trainer). Leaves every other version's relays (``registry.relays``)."""
        self.check_relay(identity, version, offer)
        model = self._model(identity)
        for v, relays in model.relays.items():
            if v != version:
                relays.leave(receiver_id)
        relays = model.relays.setdefault(version, Relays())
        if offer is not None:
            relays.checked.add(offer.layout)
        return relays.join(receiver_id, layout, offer)

    def check_relay(self, identity: Identity, version: int, offer: RelayOffer | None) -> None:
        """Raise unless ``version`` is complete and still held, and ``offer`` (if any) fits its shards."""
        model = self._peek(identity)
        ranks = model.versions.get(version)
        if ranks is None or version not in model.completed_at:  # complete, still held (newer ones may exist)
            raise VersionError("relays need their version complete and still offered", version=version)
        relays = model.relays.get(version)
        if offer is not None and (relays is None or offer.layout not in relays.checked):  # once per layout
            manifests = tuple(ranks[r] for r in range(len(ranks)))
            check_offer(Publication(identity=manifests[0].identity, version=version, manifests=manifests), offer)

    async def relay_leave(self, identity: Identity, receiver_id: str) -> None:
        """``receiver_id`` serves no version any more (it is about to change its bytes, or leaving)."""
        self._drop_relays(self._peek(identity), receiver_id)

    def _drop_relays(self, model: Model, receiver_id: str) -> None:
        for relays in model.relays.values():
            relays.leave(receiver_id)

    async def versions(self, identity: Identity) -> list[int]:
        """The versions held (complete or not), oldest first."""
        return list(self._peek(identity).order)

    async def relayed(self, identity: Identity) -> int | None:
        """The newest complete version some receiver relays (offers to its peers), or None: what a receiver
        joining a running fleet reads from its peers rather than the trainer."""
        model = self._peek(identity)
        held = [v for v, relays in model.relays.items() if relays.offers and v in model.completed_at]
        return max(held, default=None)

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
        if stale or dropped:
            self._notify()
        return list(stale)
