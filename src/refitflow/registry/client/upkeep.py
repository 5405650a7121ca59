"""What a registry client holds that the registry must hear of again, and the task that keeps it told.

While the client holds publications, receivers or undelivered reports, a background task heartbeats its
lease. When the registry restarted (its incarnation changed in any answer) or did not know the client (the
lease ran out), the task re-announces everything held: every version published here that is not known to
be released (the newest of each rank always, at most ``max_held_versions`` a rank), then every receiver
with its latest report. Reports the registry has not acknowledged are delivered by the task too.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from refitflow.core.errors import ManifestError, VersionError
from refitflow.core.types import Identity, Manifest
from refitflow.core.wire import manifest_to_dict
from refitflow.registry.messages import identity_to_dict

__all__ = ["Upkeep"]

log = logging.getLogger(__name__)


class Upkeep:
    def __init__(self, request: Callable[..., Awaitable[Any]], client_id: str, *, closed: Callable[[], bool],
                 heartbeat_s: float | None, request_timeout_s: float, max_held_versions: int) -> None:  # fmt: skip
        self._request, self.client_id, self._closed = request, client_id, closed
        self.heartbeat_s, self.request_timeout_s, self.max_held_versions = (
            heartbeat_s, request_timeout_s, max_held_versions)  # fmt: skip
        self.held: dict[tuple[str, int], dict[int, Manifest]] = {}  # (identity key, rank) -> version -> manifest
        self.receivers: dict[tuple[Identity, str], int] = {}  # registered receivers -> highest reported
        self.unsent: dict[tuple[Identity, str], int] = {}  # reports the registry has not acknowledged yet
        self.stale = False  # the registry may have forgotten what this client holds
        self._wake = asyncio.Event()  # the task has work now (a restart, a report to deliver)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Heartbeat from now on (until ``stop``)."""
        if self._task is None and not self._closed():
            self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    def restarted(self) -> None:
        """The registry restarted: re-announce what we hold."""
        self.stale = True
        self._wake.set()

    # -- what is held ----------------------------------------------------------------------------------

    def hold(self, manifest: Manifest) -> None:
        held = self.held.setdefault((manifest.identity.key(), manifest.rank), {})
        held[manifest.version] = manifest
        while len(held) > self.max_held_versions:
            del held[min(held)]
        self.start()

    def announced(self, manifest: Manifest) -> Manifest | None:
        """What this client announced for ``manifest``'s rank and version, if it holds it."""
        return self.held.get((manifest.identity.key(), manifest.rank), {}).get(manifest.version)

    def forget(self, identity: Identity, version: int) -> None:
        """``version`` is released: it and older ones are never re-announced (the newest of a rank always is)."""
        key = identity.key()
        for (held_key, _), held in self.held.items():
            if held_key == key:
                newest = max(held)
                for v in [v for v in held if v <= version and v != newest]:
                    del held[v]

    def registered(self, identity: Identity, receiver_id: str) -> None:
        self.receivers.setdefault((identity, receiver_id), -1)
        self.start()

    def unregistered(self, identity: Identity, receiver_id: str) -> None:
        self.receivers.pop((identity, receiver_id), None)
        self.unsent.pop((identity, receiver_id), None)

    def reported(self, identity: Identity, receiver_id: str, version: int) -> None:
        """``version`` is to be reported (until the registry acknowledges it)."""
        key = (identity, receiver_id)
        if key in self.receivers:
            self.receivers[key] = max(self.receivers[key], version)
        self.unsent[key] = max(self.unsent.get(key, version), version)
        self.start()

    async def send_report(self, identity: Identity, receiver_id: str, version: int, timeout: float) -> None:
        await self._request("report", timeout=timeout, identity=identity_to_dict(identity),
                            receiver_id=receiver_id, version=version)  # fmt: skip
        key = (identity, receiver_id)
        if self.unsent.get(key, version) <= version:
            self.unsent.pop(key, None)

    # -- the task --------------------------------------------------------------------------------------

    async def _run(self) -> None:
        """Heartbeat; re-announce after a restart or a lost lease; deliver reports not yet delivered."""
        interval = self.heartbeat_s or self.request_timeout_s
        while True:
            self._wake.clear()
            try:
                if self.stale:
                    await self._reannounce()
                for (identity, receiver_id), version in list(self.unsent.items()):
                    await self.send_report(identity, receiver_id, version, self.request_timeout_s)
                answer = await self._request("heartbeat", owner=self.client_id)
                if self.heartbeat_s is None:
                    interval = float(answer["lease_s"]) / 4
                if not answer["known"]:
                    self.stale = True
                    continue
            except Exception as exc:  # a registry away for a while: keep trying, re-announce on return
                log.info("registry client: heartbeat failed: %s", exc)
            try:
                await asyncio.wait_for(self._wake.wait(), interval)
            except TimeoutError:
                pass

    async def _reannounce(self) -> None:
        """Publish again every version held (newest first), then register every receiver with its report."""
        self.stale = False
        try:
            for manifest in sorted((m for held in self.held.values() for m in held.values()),
                                   key=lambda m: -m.version):  # fmt: skip
                try:
                    await self._request("publish", manifest=manifest_to_dict(manifest), owner=self.client_id)
                except (ManifestError, VersionError) as exc:  # this registry will never take it: stop offering it
                    log.warning("registry client: version %d not re-announced: %s", manifest.version, exc)
                    self.held.get((manifest.identity.key(), manifest.rank), {}).pop(manifest.version, None)
            for (identity, receiver_id), version in list(self.receivers.items()):
                await self._request("register_receiver", identity=identity_to_dict(identity),
                                    receiver_id=receiver_id, owner=self.client_id)  # fmt: skip
                if version >= 0:
                    await self.send_report(identity, receiver_id, version, self.request_timeout_s)
        except BaseException:
            self.stale = True  # not all of it got through: again next time
            raise
