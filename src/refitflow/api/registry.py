"""The embedded, in-memory registry: manifests by identity and version, receivers and their acks.

A version is discoverable once every rank of its publisher's world has published it. Receivers
register, and report each version they are done with (committed, aborted or skipped); a version is
*released* when every registered receiver is done with it, and dropped once released and
superseded by a newer complete version.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import anyio

from refitflow.core.errors import ManifestError, RefitTimeoutError, VersionError
from refitflow.core.types import Identity, Manifest, Publication

__all__ = ["Registry"]


@dataclass
class _Model:
    versions: dict[int, dict[int, Manifest]] = field(default_factory=dict)  # version -> rank -> manifest
    receivers: dict[str, int] = field(default_factory=dict)  # receiver id -> highest version done with


class Registry:
    """In one process. All methods are coroutines, as they are on a remote registry client."""

    def __init__(self) -> None:
        self._models: dict[Identity, _Model] = {}
        self._changed = anyio.Event()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    def _model(self, identity: Identity) -> _Model:
        return self._models.setdefault(identity, _Model())

    async def publish(self, manifest: Manifest) -> None:
        """Record one rank's manifest; republishing a version with other content is refused."""
        model = self._model(manifest.identity)
        ranks = model.versions.setdefault(manifest.version, {})
        for other in ranks.values():
            if other.world_size != manifest.world_size:
                raise ManifestError(
                    f"world size {manifest.world_size} disagrees with {other.world_size} of rank {other.rank}",
                    version=manifest.version,
                )
        old = ranks.get(manifest.rank)
        if old is not None and old.revision != manifest.revision:
            raise VersionError(
                f"rank {manifest.rank} already published this version with other content", version=manifest.version
            )
        ranks[manifest.rank] = manifest
        self._collect(model)
        self._notify()

    def _complete(self, model: _Model, min_version: int) -> Publication | None:
        for version in sorted(model.versions, reverse=True):
            if version < min_version:
                return None
            ranks = model.versions[version]
            world = next(iter(ranks.values())).world_size
            if len(ranks) == world:
                manifests = tuple(ranks[r] for r in range(world))
                return Publication(identity=manifests[0].identity, version=version, manifests=manifests)
        return None

    async def latest(self, identity: Identity, min_version: int = 0) -> Publication | None:
        """The newest complete version ≥ ``min_version``, or None."""
        return self._complete(self._model(identity), min_version)

    async def wait_complete(self, identity: Identity, min_version: int, timeout: float) -> Publication:
        """The newest complete version ≥ ``min_version``, waiting up to ``timeout`` seconds for one."""
        with anyio.move_on_after(timeout):
            while True:
                changed = self._changed
                pub = self._complete(self._model(identity), min_version)
                if pub is not None:
                    return pub
                await changed.wait()
        raise RefitTimeoutError(f"no complete version ≥ {min_version} of {identity.model!r} within {timeout} s")

    async def register_receiver(self, identity: Identity, receiver_id: str) -> None:
        self._model(identity).receivers.setdefault(receiver_id, -1)
        self._notify()

    async def unregister_receiver(self, identity: Identity, receiver_id: str) -> None:
        model = self._model(identity)
        model.receivers.pop(receiver_id, None)
        self._collect(model)
        self._notify()

    async def report(self, identity: Identity, receiver_id: str, version: int) -> None:
        """A receiver is done with ``version`` (and so with every older one)."""
        model = self._model(identity)
        if receiver_id in model.receivers:
            model.receivers[receiver_id] = max(model.receivers[receiver_id], version)
        self._collect(model)
        self._notify()

    def _released(self, model: _Model, version: int) -> bool:
        return all(done >= version for done in model.receivers.values())

    async def is_released(self, identity: Identity, version: int) -> bool:
        return self._released(self._model(identity), version)

    async def acked(self, identity: Identity, version: int) -> tuple[int, int]:
        """(receivers done with ``version``, receivers registered)."""
        receivers = self._model(identity).receivers
        return sum(done >= version for done in receivers.values()), len(receivers)

    async def wait_released(self, identity: Identity, version: int, timeout: float | None) -> None:
        """Return once every registered receiver is done with ``version``."""
        with anyio.move_on_after(timeout):
            while True:
                changed = self._changed
                if self._released(self._model(identity), version):
                    return
                await changed.wait()
        raise RefitTimeoutError(f"version not released within {timeout} s", version=version)

    def _collect(self, model: _Model) -> None:
        """Drop versions that are released and superseded by a newer complete version."""
        newest = self._complete(model, 0)
        if newest is None:
            return
        for version in [v for v in model.versions if v < newest.version and self._released(model, v)]:
            del model.versions[version]

    def versions(self, identity: Identity) -> list[int]:
        """The versions held (complete or not), oldest first."""
        return sorted(self._model(identity).versions)
