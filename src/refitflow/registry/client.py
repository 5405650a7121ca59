"""A remote registry: the same coroutines as :class:`Registry`, over ZMQ (asyncio only).

Requests go over one ``Channel`` (a DEALER socket with request ids: concurrent requests share it;
every request has a deadline, and a registry that doesn't answer raises ``RefitTimeoutError``).
``wait_complete`` wakes on the registry's PUB announcement (SUB socket) and re-asks every
``requery_s`` in case one was missed. Manifests are fetched once per version and cached. While
the client holds publications or receivers it heartbeats its lease in a background task; when
the registry did not know it (restarted, or the lease ran out) it re-announces them. The task
stops on ``aclose()``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from collections import OrderedDict
from collections.abc import Collection, Mapping
from types import TracebackType
from typing import Any

import zmq
import zmq.asyncio

from refitflow.core.errors import ConfigError, RefitTimeoutError, VersionError
from refitflow.core.types import Identity, Manifest, Publication
from refitflow.core.wire import manifest_from_dict, manifest_to_dict
from refitflow.registry.address import check_address
from refitflow.registry.channel import Channel
from refitflow.registry.messages import identity_to_dict, topic
from refitflow.registry.release import ReleasePolicy
from refitflow.registry.security import ClientSecurity

__all__ = ["RegistryClient"]

log = logging.getLogger(__name__)


class RegistryClient:
    def __init__(
        self,
        address: str,
        *,
        request_timeout_s: float = 5.0,
        requery_s: float = 1.0,
        heartbeat_s: float | None = None,
        security: ClientSecurity | None = None,
        context: zmq.asyncio.Context | None = None,
        cache_size: int = 16,
        client_id: str | None = None,
    ) -> None:
        if not request_timeout_s > 0 or not requery_s > 0 or (heartbeat_s is not None and not heartbeat_s > 0):
            raise ConfigError("request_timeout_s, requery_s and heartbeat_s must be positive seconds")
        self.address = check_address(address)
        self.request_timeout_s = request_timeout_s
        self.requery_s = requery_s
        self.heartbeat_s = heartbeat_s
        self.client_id = client_id or f"client-{uuid.uuid4().hex[:12]}"
        self._channel = Channel(address, request_timeout_s=request_timeout_s, security=security, context=context)
        self._request = self._channel.request
        self._sub: zmq.asyncio.Socket | None = None
        self._subscribed: set[bytes] = set()
        self._heartbeat: asyncio.Task[None] | None = None
        self._announced = asyncio.Event()
        self._hello: dict[str, Any] | None = None
        self._cache: OrderedDict[tuple[Any, ...], Publication] = OrderedDict()
        self._cache_size = cache_size
        self._fetching: dict[tuple[Any, ...], asyncio.Future[Publication]] = {}
        self._replica_cache: tuple[Any, tuple[Manifest, ...]] = (None, ())
        self._held: dict[tuple[str, int], Manifest] = {}  # (identity key, rank) -> newest manifest published
        self._receivers: dict[tuple[Identity, str], int] = {}  # registered receivers -> highest reported
        self.fetches = 0  # manifest fetches (for tests and benches: one per new version)
        self.announcements = 0  # announcements received on the SUB socket

    async def __aenter__(self) -> RegistryClient:
        return self

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:  # fmt: skip
        await self.aclose()

    # -- plumbing ---------------------------------------------------------------------------------

    async def hello(self) -> dict[str, Any]:
        if self._hello is None:
            self._hello = await self._request("hello")
        return self._hello

    async def _subscribe(self, identities: list[Identity]) -> None:
        if self._sub is None:
            pub = str((await self.hello())["pub"])
            if self.address.startswith("tcp://") and pub.startswith("tcp://"):  # reach it the way we reach the ROUTER
                pub = f"{self.address.rsplit(':', 1)[0]}:{pub.rsplit(':', 1)[1]}"
            self._sub = self._channel.socket(zmq.SUB)
            self._sub.connect(pub)
            self._channel.spawn(self._read_announcements(self._sub))
        for identity in identities:
            if topic(identity) not in self._subscribed:
                self._sub.setsockopt(zmq.SUBSCRIBE, topic(identity))
                self._subscribed.add(topic(identity))

    async def _read_announcements(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            await sock.recv_multipart()
            self.announcements += 1
            self._announced.set()
            self._announced = asyncio.Event()

    async def aclose(self) -> None:
        """Stop heartbeating, close the sockets; what this client held expires with its lease."""
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            await asyncio.gather(self._heartbeat, return_exceptions=True)
            self._heartbeat = None
        for fetching in self._fetching.values():
            fetching.cancel()
        await self._channel.aclose()

    # -- leases -----------------------------------------------------------------------------------

    def _hold_lease(self) -> None:
        if self._heartbeat is None and not self._channel.closed:
            self._heartbeat = asyncio.create_task(self._heartbeat_loop())

    async def _heartbeat_loop(self) -> None:
        interval = self.heartbeat_s or self.request_timeout_s
        while True:
            try:
                answer = await self._request("heartbeat", owner=self.client_id)
                if self.heartbeat_s is None:
                    interval = float(answer["lease_s"]) / 4
                if not answer["known"]:
                    await self._reannounce()
            except Exception as exc:  # a registry away for a while: keep trying, re-announce on return
                log.info("registry client: heartbeat failed: %s", exc)
            await asyncio.sleep(interval)

    async def _reannounce(self) -> None:
        for manifest in list(self._held.values()):
            await self._request("publish", manifest=manifest_to_dict(manifest), owner=self.client_id)
        for (identity, receiver_id), version in list(self._receivers.items()):
            await self._request("register_receiver", identity=identity_to_dict(identity),
                                receiver_id=receiver_id, owner=self.client_id)  # fmt: skip
            if version >= 0:
                await self.report(identity, receiver_id, version)

    # -- the Registry interface -------------------------------------------------------------------

    async def publish(self, manifest: Manifest) -> None:
        await self._request("publish", manifest=manifest_to_dict(manifest), owner=self.client_id)
        self._held[(manifest.identity.key(), manifest.rank)] = manifest
        self._hold_lease()

    async def latest(
        self,
        identity: Identity,
        min_version: int = 0,
        *,
        compile_targets: Collection[str] | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> Publication | None:
        found = await self._request(
            "latest", identity=identity_to_dict(identity), min_version=min_version,
            compile_targets=None if compile_targets is None else list(compile_targets),
            metadata=None if metadata is None else dict(metadata),
        )  # fmt: skip
        if found is None:
            return None
        key = (tuple(sorted(found["identity"].items())), found["version"], tuple(found["revisions"]))
        pub = self._cache.get(key)
        if pub is None:
            fetching = self._fetching.get(key)
            if fetching is None:  # one fetch per version, however many ask at once
                fetching = self._fetching[key] = asyncio.ensure_future(self._fetch(found["identity"], found["version"]))
                fetching.add_done_callback(lambda _: self._fetching.pop(key, None))
            pub = await asyncio.shield(fetching)
            self._cache[key] = pub
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        self._cache.move_to_end(key)
        replicas = tuple(found.get("replicas") or ())
        if replicas:  # tree fan-out: the receivers serving this version now (they come and go)
            pub = dataclasses.replace(pub, replicas=await self._replicas(found["identity"], pub.version, replicas))
        return pub

    async def _replicas(self, identity: dict[str, str], version: int, names: tuple[str, ...]) -> tuple[Manifest, ...]:
        key = (tuple(sorted(identity.items())), version, names)
        if self._replica_cache[0] != key:
            dicts = await self._request("replicas", identity=identity, version=version)
            self._replica_cache = (key, tuple(manifest_from_dict(d) for d in dicts))
        return self._replica_cache[1]

    async def publish_replica(self, manifest: Manifest) -> None:
        await self._request("publish_replica", manifest=manifest_to_dict(manifest))

    async def withdraw_replica(self, identity: Identity, receiver_id: str) -> None:
        await self._request("withdraw_replica", identity=identity_to_dict(identity), receiver_id=receiver_id)

    async def _fetch(self, identity: dict[str, str], version: int) -> Publication:
        dicts = await self._request("manifests", identity=identity, version=version)
        self.fetches += 1
        # validating thousands of shard specs is CPU work: off the event loop, which keeps serving
        manifests = await asyncio.to_thread(lambda: tuple(manifest_from_dict(d) for d in dicts))
        if not manifests:
            raise VersionError("the registry returned no manifests", version=version)
        return Publication(identity=manifests[0].identity, version=version, manifests=manifests)

    async def wait_complete(
        self,
        identity: Identity,
        min_version: int,
        timeout: float,
        *,
        compile_targets: Collection[str] | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> Publication:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        targets = [identity.compile_target] if compile_targets is None else list(compile_targets)
        topics = [Identity(**{**identity_to_dict(identity), "compile_target": t}) for t in targets]
        last: Exception | None = None
        try:
            async with asyncio.timeout(timeout):
                while True:
                    announced = self._announced
                    try:  # subscribe (once) inside the loop: a registry down at first is asked again
                        await self._subscribe(topics)
                        pub = await self.latest(identity, min_version, compile_targets=compile_targets,
                                                metadata=metadata)  # fmt: skip
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
        self._receivers.setdefault((identity, receiver_id), -1)
        self._hold_lease()

    async def unregister_receiver(self, identity: Identity, receiver_id: str) -> None:
        self._receivers.pop((identity, receiver_id), None)
        await self._request("unregister_receiver", identity=identity_to_dict(identity), receiver_id=receiver_id)

    async def report(self, identity: Identity, receiver_id: str, version: int) -> None:
        key = (identity, receiver_id)
        if key in self._receivers:
            self._receivers[key] = max(self._receivers[key], version)
        await self._request("report", identity=identity_to_dict(identity), receiver_id=receiver_id, version=version)

    async def is_released(self, identity: Identity, version: int, *, policy: ReleasePolicy | None = None) -> bool:
        return bool(await self._request("is_released", identity=identity_to_dict(identity), version=version,
                                        policy=None if policy is None else policy.to_dict()))  # fmt: skip

    async def acked(self, identity: Identity, version: int) -> tuple[int, int]:
        done, registered = await self._request("acked", identity=identity_to_dict(identity), version=version)
        return int(done), int(registered)

    async def wait_released(
        self, identity: Identity, version: int, timeout: float | None, *, policy: ReleasePolicy | None = None
    ) -> None:
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            wait_s = 10.0 if deadline is None else min(10.0, max(0.0, deadline - loop.time()))
            released = await self._request(
                "wait_released", timeout=wait_s + self.request_timeout_s, identity=identity_to_dict(identity),
                version=version, wait_s=wait_s, policy=None if policy is None else policy.to_dict(),
            )  # fmt: skip
            if released:
                return
            if deadline is not None and loop.time() >= deadline:
                raise RefitTimeoutError(f"version not released within {timeout} s", version=version)

    async def near_misses(self, identity: Identity, min_version: int = 0) -> list[str]:
        """What the registry holds of ``identity.model`` that does not match (for a discovery timeout)."""
        return [str(s) for s in await self._request("near_misses", identity=identity_to_dict(identity),
                                                    min_version=min_version)]  # fmt: skip

    async def versions(self, identity: Identity) -> list[int]:
        return list(await self._request("versions", identity=identity_to_dict(identity)))
