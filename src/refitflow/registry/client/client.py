"""A remote registry: the same coroutines as :class:`Registry`, over ZMQ (asyncio only).

Requests go over one ``Channel`` per registry replica (a DEALER socket with request ids: concurrent requests
share it; every request has a deadline, and a registry that doesn't answer raises ``RefitTimeoutError``);
``address`` may name several replicas of one store (``"tcp://h1:7100,tcp://h2:7100"``): a request fails
over to the next within its deadline (``replicas``).
``wait_complete`` wakes on the registry's PUB announcement (SUB socket, ``announcements``) and re-asks
every ``requery_s`` in case one was missed. Manifests are fetched once per version and cached (``fetched``).

What the client holds (publications, receivers, reports) is kept told to the registry by a background task
(``upkeep``: heartbeats, re-announcement after a restart). ``report`` never holds a refit up for long: it waits
at most ``report_wait_s`` (not at all while the registry is not answering), and a report not delivered then
is delivered by the task. The task stops on ``aclose()``. The calls that are one request and nothing more take
their signatures from the protocol (``registry.implement.Remote``).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable, Collection, Mapping
from functools import partial
from types import TracebackType
from typing import Any

import zmq
import zmq.asyncio

from refitflow.core.errors import ConfigError, ManifestError, RefitError, RefitTimeoutError, VersionError
from refitflow.core.fanout import RelayLayouts, RelayOffer
from refitflow.core.offers import KNOWN, offer_from_dict, offer_to_dict
from refitflow.core.types import Identity, Manifest, Publication
from refitflow.core.wire import UNKNOWN_LAYOUT
from refitflow.registry.address import check_addresses
from refitflow.registry.client.announcements import Announcements
from refitflow.registry.client.fetched import Fetched
from refitflow.registry.client.publishing import Announcing
from refitflow.registry.client.replicas import Replicas
from refitflow.registry.client.upkeep import Upkeep
from refitflow.registry.implement import Remote
from refitflow.registry.messages import identity_to_dict
from refitflow.registry.protocol import RegistryProtocol
from refitflow.registry.release import ReleasePolicy
from refitflow.registry.security import ClientSecurity

__all__ = ["RegistryClient"]

log = logging.getLogger(__name__)


class RegistryClient(RegistryProtocol):
    def __init__(
        self,
        address: str | list[str],
        *,
        request_timeout_s: float = 5.0,
        requery_s: float = 1.0,
        heartbeat_s: float | None = None,
        security: ClientSecurity | None = None,
        context: zmq.asyncio.Context | None = None,
        cache_size: int = 16,
        client_id: str | None = None,
        report_wait_s: float = 1.0,
        max_held_versions: int = 1024,
    ) -> None:
        seconds = (request_timeout_s, requery_s, report_wait_s, 1.0 if heartbeat_s is None else heartbeat_s)
        if not all(s > 0 for s in seconds):
            raise ConfigError("request_timeout_s, requery_s, report_wait_s and heartbeat_s must be positive seconds")
        if max_held_versions < 1:
            raise ConfigError(f"max_held_versions must be at least 1, got {max_held_versions}")
        addresses = check_addresses(address)
        self.address = ",".join(addresses)
        self.request_timeout_s = request_timeout_s
        self.requery_s = requery_s
        self.heartbeat_s = heartbeat_s
        self.report_wait_s = report_wait_s
        self.max_held_versions = max_held_versions
        self.client_id = client_id or f"client-{uuid.uuid4().hex[:12]}"
        self._channel = Replicas(addresses, request_timeout_s=request_timeout_s, security=security, context=context,
                                 on_restart=self._restarted)  # fmt: skip
        self._channel.on_failover = self._failed_over
        self._request = self._channel.request
        self._upkeep = Upkeep(lambda *a, **k: self._request(*a, **k), self.client_id,
                              closed=lambda: self._channel.closed, heartbeat_s=heartbeat_s,
                              request_timeout_s=request_timeout_s, max_held_versions=max_held_versions)  # fmt: skip
        self._announcements = Announcements(self._channel.channels[0])
        self._hello: dict[str, Any] | None = None
        self._hello_via = addresses[0]  # the replica that answered ``hello``
        self._fetched = Fetched(self._request, cache_size)
        self._layouts = RelayLayouts()  # relay geometries known here (and to the registry): offers travel compact
        self._announcing = Announcing(lambda *a, **k: self._request(*a, **k), self.hello, self._upkeep,
                                      self.client_id)  # fmt: skip

    @property
    def announcements(self) -> int:
        """Announcements received on the SUB socket."""
        return self._announcements.count

    @property
    def fetches(self) -> int:
        """Whole-publication fetches so far (for tests and benches: one per new version)."""
        return self._fetched.fetches

    @property
    def fetched(self) -> Fetched:
        """What this client fetched (layouts, parts: for benches)."""
        return self._fetched

    async def __aenter__(self) -> RegistryClient:
        return self

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:  # fmt: skip
        await self.aclose()

    # -- plumbing ---------------------------------------------------------------------------------

    async def hello(self) -> dict[str, Any]:
        """The registry's ``hello`` (asked again after it restarted, or when the replica it came from announces
        elsewhere now: restarted over a shared store, the same incarnation, another announcement port)."""
        if self._hello is not None:
            now = next((c.pub for c in self._channel.channels if c.address == self._hello_via), None)
            if now is not None and now != self._hello.get("pub"):
                self._hello = None
        if self._hello is None:
            self._hello = await self._request("hello")
            self._hello_via = self._channel.answered_by.address
        return self._hello

    def _failed_over(self) -> None:
        """Another replica answers now: learn where it announces (``wait_complete`` subscribes there too); what
        this client sent the last one by reference (parts) is sent again once."""
        self._hello = None
        self._fetched.forget_parts()

    def _restarted(self) -> None:
        """The registry restarted: re-announce what we hold, re-learn where it announces; the layouts and parts
        it held are sent again."""
        self._hello = None
        self._announcing.layouts.clear()
        self._fetched.forget_parts()
        self._upkeep.restarted()

    async def aclose(self) -> None:
        """Stop heartbeating, close the sockets; what this client held expires with its lease. A client that
        published says goodbye (within a second, if the registry answers): its ranks may be published by
        another client at once."""
        await self._upkeep.stop()
        if self._upkeep.held and self._channel.answering and not self._channel.closed:
            try:
                await self._request("goodbye", timeout=min(1.0, self.request_timeout_s), owner=self.client_id)
            except RefitError as exc:
                log.info("registry client: goodbye not delivered (%s): the lease runs out instead", exc)
        self._fetched.cancel()
        await self._channel.aclose()

    # -- the Registry interface -------------------------------------------------------------------

    async def publish(self, manifest: Manifest) -> None:
        """Announce ``manifest``: its layout once, then per version its record (``publishing``). A registry that does
        not answer in time (down, or cut off by the network) is a ``RefitTimeoutError`` — and the version is held all
        the same: the lease task announces it as soon as the registry answers again (with every other version
        held), so receivers get it after the outage.

        A rank another live client publishes (a predecessor that crashed, whose lease has not run out yet) is
        asked again until one lease has passed; then the registry's ``VersionError`` is raised.

        The digests of a manifest this client announced pending (two-phase publication) go alone, without the
        layout the registry holds already; a registry that no longer holds it gets the whole manifest."""
        await self._announcing.publish(manifest)

    async def _found(
        self, identity: Identity, min_version: int, compile_targets: Collection[str] | None,
        metadata: Mapping[str, str] | None, early: bool, skip: Collection[int],
    ) -> dict[str, Any] | None:  # fmt: skip
        found: dict[str, Any] | None = await self._request(
            "latest", identity=identity_to_dict(identity), min_version=min_version,
            compile_targets=None if compile_targets is None else list(compile_targets),
            metadata=None if metadata is None else dict(metadata), early=early, skip=sorted(skip)[-64:],
        )  # fmt: skip
        return found

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
        found = await self._found(identity, min_version, compile_targets, metadata, early, skip)
        return None if found is None else await self._fetched.get(found)

    async def relay_join(
        self, identity: Identity, version: int, receiver_id: str, *, layout: str = "", offer: RelayOffer | None = None,
        keep: int | None = None,
    ) -> RelayOffer | None:
        """Join ``version``'s relays (``Registry.relay_join``); the upstream to read from, or None.

        An offer goes by geometry (``core.offers``: its layout, address id, status, regions — O(1) in the model's
        size) when the registry holds its layout (any receiver of that geometry joined whole before) and this
        client's address (it joined before); the upstream's comes back so when this client knows its layout and
        address (the few most recent it lists). A registry that does not hold them (the first of a geometry, a
        restart, another replica) refuses the compact form and gets the whole offer: one more round trip."""
        compact = offer is not None
        source_known = offer is not None and self._layouts.has_source(offer.source)
        if offer is not None:  # known here from now: an upstream of this layout may come back compact
            self._layouts.add(offer)
        while True:
            try:
                sent = None if offer is None else offer_to_dict(offer, compact=compact, source_known=source_known)
                found = await self._request(
                    "relay_join", identity=identity_to_dict(identity), version=version, receiver_id=receiver_id,
                    layout=layout, offer=sent, keep=keep, layouts=self._layouts.names()[-KNOWN:],
                    sources=self._layouts.source_ids()[-KNOWN:],
                    max_bytes=(await self.hello()).get("max_message_bytes"),
                )  # fmt: skip
                break
            except ManifestError as exc:
                if not (compact or source_known) or UNKNOWN_LAYOUT not in exc.reason:
                    raise
                compact = source_known = False
        if offer is not None:
            self._layouts.add_source(offer.source)  # the registry holds it now
        if found is None:
            return None
        decode = partial(offer_from_dict, layouts=self._layouts)
        return await asyncio.to_thread(decode, found) if len(found.get("held", ())) > 256 else decode(found)

    relay_leave = Remote(RegistryProtocol.relay_leave)

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
        return await self._wait(self._fetched.get, identity, min_version, timeout, compile_targets, metadata, early,
                                skip)  # fmt: skip

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
        """As ``wait_complete``, as a receiver needs the version: its layouts (fetched once each) and a plan's part
        of its digests, fetched alone (``core.records.Outline``, ``fetched``)."""
        return await self._wait(self._fetched.outline, identity, min_version, timeout, compile_targets, metadata,
                                early, skip)  # fmt: skip

    async def _wait(
        self, get: Callable[[dict[str, Any]], Awaitable[Publication]], identity: Identity, min_version: int,
        timeout: float, compile_targets: Collection[str] | None, metadata: Mapping[str, str] | None, early: bool,
        skip: Collection[int],
    ) -> Publication:  # fmt: skip
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        targets = [identity.compile_target] if compile_targets is None else list(compile_targets)
        topics = [Identity(**{**identity_to_dict(identity), "compile_target": t}) for t in targets]
        last: Exception | None = None
        try:
            async with asyncio.timeout(timeout):
                while True:
                    announced = self._announcements.event
                    try:  # subscribe (once) inside the loop: a registry down at first is asked again
                        hello = await self.hello()
                        self._announcements.subscribe(str(hello["pub"]), topics, self._hello_via)
                        self._announcements.everywhere(self._channel.channels)
                        found = await self._found(identity, min_version, compile_targets, metadata, early, skip)
                        pub = None if found is None else await get(found)
                    except (VersionError, RefitTimeoutError) as exc:  # withdrawn before fetched, or no answer
                        pub, last = None, exc
                    if pub is not None:
                        return pub
                    wait = min(self.requery_s, max(0.0, deadline - loop.time()))
                    try:
                        await asyncio.wait_for(announced.wait(), wait)
                    except TimeoutError:
                        pass
        except TimeoutError:
            pass
        why = f" (last: {last})" if last is not None else ""
        raise RefitTimeoutError(f"no complete version ≥ {min_version} of {identity.model!r} within {timeout} s{why}")

    async def register_receiver(self, identity: Identity, receiver_id: str) -> None:
        await self._request("register_receiver", identity=identity_to_dict(identity), receiver_id=receiver_id,
                            owner=self.client_id)  # fmt: skip
        self._upkeep.registered(identity, receiver_id)

    async def unregister_receiver(self, identity: Identity, receiver_id: str) -> None:
        self._upkeep.unregistered(identity, receiver_id)
        await self._request("unregister_receiver", identity=identity_to_dict(identity), receiver_id=receiver_id)

    async def report(self, identity: Identity, receiver_id: str, version: int) -> None:
        """Tell the registry ``receiver_id`` is done with ``version``: delivered within ``report_wait_s`` or
        later by the background task (kept for a restarted registry too); never a timeout here."""
        self._upkeep.reported(identity, receiver_id, version)
        if not self._channel.answering:  # the registry is away: don't wait for it
            return
        try:
            await self._upkeep.send_report(identity, receiver_id, version,
                                           min(self.report_wait_s, self.request_timeout_s))  # fmt: skip
        except RefitTimeoutError:
            log.info("registry client: report of version %d delivered later", version)

    async def is_released(self, identity: Identity, version: int, *, policy: ReleasePolicy | None = None) -> bool:
        released = bool(await self._request("is_released", identity=identity_to_dict(identity), version=version,
                                            policy=None if policy is None else policy.to_dict()))  # fmt: skip
        if released:
            self._upkeep.forget(identity, version)
        return released

    async def wait_released(
        self, identity: Identity, version: int, timeout: float | None, *, policy: ReleasePolicy | None = None
    ) -> None:
        """Return once ``version`` is released; a registry away for a while is asked again until ``timeout``."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            wait_s = 10.0 if deadline is None else min(10.0, max(0.0, deadline - loop.time()))
            try:
                released = await self._request(
                    "wait_released", timeout=wait_s + self.request_timeout_s, identity=identity_to_dict(identity),
                    version=version, wait_s=wait_s, policy=None if policy is None else policy.to_dict(),
                )  # fmt: skip
            except RefitTimeoutError as exc:  # no answer, or busy: ask again (not at once)
                released = False
                log.info("registry client: waiting for the release of version %d: %s", version, exc)
                await asyncio.sleep(min(self.requery_s, wait_s))
            if released:
                self._upkeep.forget(identity, version)
                return
            if deadline is not None and loop.time() >= deadline:
                raise RefitTimeoutError(f"version not released within {timeout} s", version=version)

    # -- the calls that are one request -----------------------------------------------------------------

    acked = Remote(RegistryProtocol.acked, result=lambda found: (int(found[0]), int(found[1])))
    near_misses = Remote(RegistryProtocol.near_misses, result=lambda found: [str(s) for s in found])
    versions = Remote(RegistryProtocol.versions, result=list)
    relayed = Remote(RegistryProtocol.relayed, result=lambda found: found if type(found) is int else None)
