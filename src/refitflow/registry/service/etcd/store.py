"""The registry's state in etcd: any number of stateless replicas serve one deployment.

Every replica holds a *mirror* (the in-memory ``RegistryStore``) fed only by an etcd watch, in revision
order, so all replicas hold the same state; reads and waits are served from it. A change is checked
against the mirror, written as one etcd transaction, and answered once the replica's own mirror has
applied that revision (read-your-writes):

- **publish**: compare-and-set on the version's key (its mod revision as the mirror saw it) and put the
  rank's manifest under the publisher's lease. Two replicas publishing ranks of one version at once: one
  transaction wins, the other re-checks against the newer state and tries again; a version is never
  published twice with other content, and a committed publication lives while a majority of etcd does.
- **liveness** is an etcd lease per owner (a remote client): granted at its first request, kept alive by its
  heartbeats (no key is rewritten), looked up by any replica (``o/<owner>``). What an owner published or
  registered carries its lease and goes with it.
- **announcements** come from the watch: every replica announces a version that became the newest complete
  (or laid out) one, so the death of the replica that took the publish loses none.
- **clean-up** (every replica, idempotent): a version its mirror dropped (released and superseded) or whose
  every rank's lease ran out is deleted from etcd with one range delete; so is an incomplete version no
  lease holds once ``limits.incomplete_ttl_s`` has passed.

How the mirror follows etcd (the watch, its restarts, what each key means): ``etcd.watch``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.to_thread
import orjson

from refitflow.core.errors import RefitTimeoutError, TransportError
from refitflow.core.fanout import Geometry, Relay, RelayOffer
from refitflow.core.offers import geometry_to_dict, relay_to_dict
from refitflow.core.records import Announcement, RankLayout, RankRecord, record_to_dict
from refitflow.core.types import Identity, Manifest, SourceAddress
from refitflow.core.wire import decode, encode
from refitflow.registry.implement import Forward
from refitflow.registry.limits import RegistryLimits
from refitflow.registry.messages import identity_to_dict
from refitflow.registry.protocol import Store
from refitflow.registry.service.etcd import kv
from refitflow.registry.service.etcd.keys import EtcdTLS, Keys, blob_value, endpoints_of
from refitflow.registry.service.etcd.kv import Etcd
from refitflow.registry.service.etcd.watch import Replication
from refitflow.registry.service.relay_joins import join_whole
from refitflow.registry.service.store import RegistryStore, claimed

__all__ = ["EtcdStore"]

log = logging.getLogger(__name__)

_CAS_TRIES = 16


class EtcdStore(Replication, Store):
    """The ``RegistryStore`` interface over etcd (``open``: ``etcd://h1:2379,h2:2379,h3:2379``)."""

    announces = True  # its watch announces; the service does not announce publishes itself

    def __init__(self, etcd: Etcd, *, namespace: str = "default", lease_s: float = 10.0,
                 limits: RegistryLimits | None = None) -> None:  # fmt: skip
        self.etcd = etcd
        self.keys = Keys(namespace)
        lease_s = float(max(2, math.ceil(lease_s)))  # etcd's leases: whole seconds, 2 at least (what hello says)
        self.mirror = RegistryStore(lease_s=lease_s, limits=limits)
        self.lease_s, self.limits = lease_s, self.mirror.limits
        self.incarnation = ""
        self.on_announce: Callable[[dict[str, str], int], Awaitable[None]] | None = None
        self._applied = 0  # the revision the mirror has applied
        self._applying = 0  # > 0 while a watch batch (or a load) is half applied: a version key before its manifest
        self._advanced = asyncio.Event()
        self._owners: dict[str, int] = {}  # owner -> its lease (o/ keys)
        self._meaning: dict[bytes, tuple[str, Identity, Any]] = {}  # key -> what it holds (for its deletion)
        self._vrev: dict[tuple[Identity, int], int] = {}  # a version key's mod revision
        self._leases: dict[bytes, int] = {}  # manifest and receiver keys -> their lease
        self._joined: dict[tuple[Identity, str], tuple[int, Any]] = {}  # a relay join's revision and outcome
        self._announced: dict[Identity, tuple[int | None, int | None]] = {}
        self._claims: dict[tuple[Identity, int], str] = {}  # (identity, rank) -> the owner publishing it (c/ keys)
        self._layout_keys: set[str] = set()  # the layouts etcd holds (l/ keys, as the watch saw them)
        self._carried: set[Any] = set()  # relay geometries (layout digests) and addresses some x/ key carried
        self._decoding = anyio.CapacityLimiter(2)
        self._tasks: list[asyncio.Task[None]] = []
        self._watch: asyncio.Task[None] | None = None
        self._progress: asyncio.Queue[None] = asyncio.Queue()  # progress requests to the watch
        self._heard = 0.0  # when the watch last said anything

    @classmethod
    @asynccontextmanager
    async def open(
        cls,
        url: str,
        *,
        namespace: str = "default",
        lease_s: float = 10.0,
        limits: RegistryLimits | None = None,
        op_timeout_s: float = 4.0,
        tls: EtcdTLS | None = None,
    ) -> AsyncIterator[EtcdStore]:
        """A replica's store on the etcd cluster at ``url`` (``etcd://h1:2379,h2:2379``); ``tls``: speak TLS to it."""
        etcd = Etcd(endpoints_of(url), op_timeout_s=op_timeout_s, tls=tls)
        store = cls(etcd, namespace=namespace, lease_s=lease_s, limits=limits)
        try:
            await store._start()
            yield store
        finally:
            for task in store._tasks + ([store._watch] if store._watch else []):
                task.cancel()
            await asyncio.gather(*store._tasks, *([store._watch] if store._watch else []), return_exceptions=True)
            await etcd.aclose()

    # -- replication ----------------------------------------------------------------------------------

    async def _start(self) -> None:
        key, inc = self.keys.incarnation(), uuid.uuid4().hex
        ok, _, responses = await self.etcd.txn([kv.missing(key)], [kv.put(key, inc.encode())], [kv.get(key)])
        self.incarnation = inc if ok else responses[0].response_range.kvs[0].value.decode()
        await self._load()
        self._tasks = [asyncio.create_task(self._supervise()), asyncio.create_task(self._janitor())]

    async def _write(self, compare: list[Any], success: list[Any], failure: list[Any] | None = None
                     ) -> tuple[bool, Any]:  # fmt: skip
        """One transaction; when it changed something, answered once this replica's mirror applied it (a
        transaction that deleted nothing has no event to wait for: its revision is the cluster's, not its own)."""
        ok, revision, responses = await self.etcd.txn(compare, success, failure or [])
        changed = any(r.WhichOneof("response") != "response_delete_range" or r.response_delete_range.deleted
                      for r in responses)  # fmt: skip
        if ok and changed:
            await self._caught_up(revision)
        return ok, responses

    # -- owners and their leases ----------------------------------------------------------------------

    async def _lease_of(self, owner: str | None) -> int:
        if owner is None:
            return 0
        lease = self._owners.get(owner)
        if lease:
            return lease
        key = self.keys.owner(owner)
        new = await self.etcd.grant(int(self.lease_s))
        ok, responses = await self._write([kv.missing(key)], [kv.put(key, str(new).encode(), new)], [kv.get(key)])
        if ok:
            return new
        await self.etcd.revoke(new)  # another replica granted one first
        return int(responses[0].response_range.kvs[0].lease)

    async def _with_lease(self, owner: str | None, write: Callable[[int], Awaitable[Any]]) -> Any:
        """``write(lease)``; once more with a new lease if etcd says the owner's has just expired."""
        for attempt in range(2):
            lease = await self._lease_of(owner)
            try:
                return await write(lease)
            except TransportError as exc:
                if attempt or "lease not found" not in str(exc) or owner is None:
                    raise
                self._owners.pop(owner, None)
        raise AssertionError("unreachable")

    async def goodbye(self, owner: str) -> None:
        """``owner`` closed: its ranks may be published by another client at once."""
        mine = [self.keys.claim(i, r) for (i, r), o in self._claims.items() if o == owner]
        if mine:
            await self._write([], [kv.delete(k) for k in mine])

    async def heartbeat(self, owner: str) -> bool:
        """Keep ``owner``'s lease alive; False when it had none (expired, or never held): it re-announces."""
        lease = self._owners.get(owner)
        if lease and await self.etcd.keepalive(lease):
            return True
        self._owners.pop(owner, None)
        await self._lease_of(owner)
        return False

    # -- writes --------------------------------------------------------------------------------------

    async def publish(self, manifest: Manifest, *, owner: str | None = None) -> None:
        layout = self.mirror.layout_of(manifest)  # checked once per layout
        await self.publish_entry(Announcement(layout, manifest.version, manifest.revision, None, manifest=manifest),
                                 owner=owner)  # fmt: skip

    async def add_layout(self, layout: RankLayout) -> RankLayout:
        return self.mirror.hold_layout(layout)  # written to etcd with its first record (``_write_layout``)

    async def _write_layout(self, layout: RankLayout) -> None:
        """Write ``layout`` to etcd once (every replica's watch then holds it), before a record names it."""
        if layout.id in self._layout_keys:
            return
        key = self.keys.layout(layout.id)
        head, chunks = await anyio.to_thread.run_sync(blob_value, key, {"layout": orjson.Fragment(layout.encoded)})
        for chunk_key, chunk in chunks:  # a large layout: its chunks first, then its head
            await self.etcd.txn([kv.missing(key)], [kv.put(chunk_key, chunk)])
        await self._write([kv.missing(key)], [kv.put(key, head)])
        self._layout_keys.add(layout.id)

    async def publish_entry(self, entry: Announcement, *, owner: str | None = None) -> None:
        identity, version, rank = entry.identity, entry.version, entry.rank
        vkey, mkey = self.keys.version(identity, version), self.keys.manifest(identity, version, rank)
        await self._write_layout(entry.layout)
        record = RankRecord(identity=identity, version=version, rank=rank, layout=entry.layout.id,
                            revision=entry.revision, digests=entry.raw)  # fmt: skip
        head, chunks = await anyio.to_thread.run_sync(blob_value, mkey, {"record": record_to_dict(record)})
        vdoc = encode({"identity": identity_to_dict(identity), "version": version})
        ckey = self.keys.claim(identity, rank)
        cdoc = encode({"identity": identity_to_dict(identity), "rank": rank, "owner": owner})

        async def write(lease: int) -> None:
            for chunk_key, chunk in chunks:  # a large record: its chunks first (under the lease), then its head
                await self.etcd.txn([], [kv.put(chunk_key, chunk, lease)])
            # the first round compares with the mirror; a lost one with what etcd said the keys hold (the mirror
            # may lag: a claim whose lease ended is a deletion, and no key's revision tells of it)
            holder, seen = self._claims.get((identity, rank)), self._vrev.get((identity, version), 0)
            for _ in range(_CAS_TRIES):
                if owner is not None and holder not in (None, owner):
                    raise claimed(entry, self.lease_s)
                if not self.mirror.admit(entry):
                    return
                compare, success = [kv.mod_is(vkey, seen)], [kv.put(vkey, vdoc), kv.put(mkey, head, lease)]
                if owner is not None:  # the rank's claim: taken now, or still this owner's (one transaction)
                    compare.append(kv.missing(ckey) if holder is None else kv.value_is(ckey, cdoc))
                    success.append(kv.put(ckey, cdoc, lease))
                ok, found = await self._write(compare, success, [kv.get(vkey), kv.get(ckey)])
                if ok:
                    return
                # another replica changed the version, or another client took the rank: see that, try again
                (vkv, ckv) = (list(r.response_range.kvs) for r in found)
                seen = vkv[0].mod_revision if vkv else 0
                holder = str(decode(ckv[0].value)["owner"]) if ckv else None
                await self._version_seen(identity, version, seen)  # admit() checks the mirror: as etcd answered
            raise RefitTimeoutError(f"version {version}: {_CAS_TRIES} compare-and-set rounds lost", version=version)

        await self._with_lease(owner, write)

    async def register_receiver(self, identity: Identity, receiver_id: str, *, owner: str | None = None) -> None:
        done = self.mirror.model(identity).receivers.get(receiver_id, -1)
        value = encode({"identity": identity_to_dict(identity), "receiver": receiver_id, "done": done})
        key = self.keys.receiver(identity, receiver_id)
        await self._with_lease(owner, lambda lease: self._write([], [kv.put(key, value, lease)]))

    async def report(self, identity: Identity, receiver_id: str, version: int) -> None:
        done = self.mirror.model(identity).receivers.get(receiver_id)
        if done is None or done >= version:
            return  # not registered (as in memory: ignored), or nothing new: nothing rewritten
        key = self.keys.receiver(identity, receiver_id)
        value = encode({"identity": identity_to_dict(identity), "receiver": receiver_id, "done": version})
        await self._write([kv.exists(key)], [kv.put(key, value, ignore_lease=True)])

    async def unregister_receiver(self, identity: Identity, receiver_id: str) -> None:
        relay = self.keys.relay(identity, receiver_id)
        await self._write([], [kv.delete(self.keys.receiver(identity, receiver_id)), kv.delete(relay),
                               kv.delete(relay + b"/c/", prefix=True)])  # fmt: skip

    async def relay_join(
        self, identity: Identity, version: int, receiver_id: str, *, layout: str = "", offer: RelayOffer | None = None,
        keep: int | None = None,
    ) -> RelayOffer | None:
        return await join_whole(self, identity, version, receiver_id, layout, offer, keep)

    async def add_relay_geometry(self, layout: str, geometry: Geometry) -> None:
        await self.mirror.add_relay_geometry(layout, geometry)  # carried to etcd by a join (``join_relays``)

    async def add_relay_source(self, source: SourceAddress) -> None:
        await self.mirror.add_relay_source(source)

    async def join_relays(
        self, identity: Identity, version: int, receiver_id: str, layout: str, relay: Relay | None,
        keep: int | None = None,
    ) -> Relay | None:
        """Write the join by geometry (the geometry and address whole only when etcd has not carried them yet)."""
        self.mirror.check_relay(identity, version, relay)
        key = self.keys.relay(identity, receiver_id)
        doc: dict[str, Any] = {"identity": identity_to_dict(identity), "receiver": receiver_id, "version": version,
                               "layout": layout, "relay": None, "keep": keep}  # fmt: skip
        if relay is not None:
            doc["relay"] = relay_to_dict(identity, version, relay, source_known=relay.source in self._carried)
            if relay.layout not in self._carried:
                tensors, held = self.mirror.relay_geometry(relay.layout) or ((), ())
                doc["geometry"] = geometry_to_dict(tensors, held)
        head, chunks = await anyio.to_thread.run_sync(blob_value, key, doc)
        lease = self._leases.get(self.keys.receiver(identity, receiver_id), 0)
        await self.etcd.delete_prefix(key + b"/c/")  # the chunks of its last join
        for chunk_key, chunk in chunks:
            await self.etcd.txn([], [kv.put(chunk_key, chunk, lease)])
        _, revision, _ = await self.etcd.txn([], [kv.put(key, head, lease)])
        await self._caught_up(revision)
        at, outcome = self._joined.get((identity, receiver_id), (0, None))
        if at != revision:
            raise RefitTimeoutError("the relay join was overtaken by another of the same receiver; join again")
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    async def relay_leave(self, identity: Identity, receiver_id: str) -> None:
        relay = self.keys.relay(identity, receiver_id)
        await self._write([], [kv.delete(relay), kv.delete(relay + b"/c/", prefix=True)])

    def hold_releases(self, seconds: float) -> None:
        self.mirror.hold_releases(seconds)

    def extend_leases(self, seconds: float) -> None:
        """Nothing to do: etcd keeps the leases, and clients of a stalled replica fail over to another."""

    def expire(self) -> list[str]:
        """Leases expire in etcd itself (their keys go, the watch tells every replica)."""
        return []

    async def _janitor(self) -> None:
        """Delete from etcd what no replica should hold any more (idempotent: every replica does it)."""
        while True:
            await asyncio.sleep(max(0.2, self.lease_s / 4))
            now = self.mirror.now()
            for (identity, version), _ in list(self._vrev.items()):
                if self._applying:  # a version key may be applied before its manifest: judge a whole mirror only
                    break
                model = self.mirror.model(identity)
                gone = version not in model.versions  # released and superseded, or every rank's lease ran out
                ranks = model.versions.get(version, {})
                leased = any(self._leases.get(self.keys.manifest(identity, version, r)) for r in ranks)
                stale = (not gone and not leased and version not in model.completed_at
                         and now - model.first_seen.get(version, now) > self.limits.incomplete_ttl_s)  # fmt: skip
                if gone or stale:
                    try:
                        await self.etcd.delete_prefix(self.keys.version(identity, version))
                    except (RefitTimeoutError, TransportError) as exc:
                        log.info("registry (etcd): clean-up of version %d deferred: %s", version, exc)
            if not self._applying:  # layouts no version announces any more, once their grace has passed
                for lid in self.mirror.prune_layouts(now) & self._layout_keys:
                    try:
                        await self.etcd.delete_prefix(self.keys.layout(lid))
                    except (RefitTimeoutError, TransportError) as exc:
                        log.info("registry (etcd): clean-up of a layout deferred: %s", exc)

    # -- reads: the mirror ---------------------------------------------------------------------------

    layout = Forward(Store.layout)
    entry_of = Forward(Store.entry_of)
    entry = Forward(Store.entry)
    find = Forward(Store.find)
    relay_geometry = Forward(Store.relay_geometry)
    relay_source = Forward(Store.relay_source)
    offer_of = Forward(Store.offer_of)

    newest_complete = Forward(RegistryStore.newest_complete)
    is_newest = Forward(Store.is_newest)
    announced = Forward(Store.announced)
    latest = Forward(Store.latest)
    wait_complete = Forward(Store.wait_complete)
    wait_outline = Forward(Store.wait_outline)
    is_released = Forward(Store.is_released)
    acked = Forward(Store.acked)
    wait_released = Forward(Store.wait_released)
    versions = Forward(Store.versions)
    relayed = Forward(Store.relayed)
    near_misses = Forward(Store.near_misses)
