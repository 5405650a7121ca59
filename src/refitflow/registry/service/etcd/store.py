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

A watch that fails, or falls behind the cluster's revision, is restarted on another member from the
last revision applied (or reloaded whole, if etcd compacted that history).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Iterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.to_thread

from refitflow.core.errors import ManifestError, RefitTimeoutError, TransportError, VersionError
from refitflow.core.fanout import RelayOffer
from refitflow.core.types import Identity, Manifest, Publication
from refitflow.core.wire import decode, encode, manifest_from_dict, manifest_to_dict, offer_from_dict, offer_to_dict
from refitflow.registry.limits import RegistryLimits
from refitflow.registry.messages import identity_from_dict, identity_to_dict
from refitflow.registry.release import ReleasePolicy
from refitflow.registry.service.etcd import kv
from refitflow.registry.service.etcd.keys import EtcdTLS, Keys, blob_value, chunked, endpoints_of, join_chunks
from refitflow.registry.service.etcd.kv import KV, Etcd, RevisionCompacted
from refitflow.registry.service.store import RegistryStore, claimed

__all__ = ["EtcdStore"]

log = logging.getLogger(__name__)

_CAS_TRIES = 16
_BIG = 256  # shard specs (or held boxes) above which a value is decoded in a worker thread


class EtcdStore:
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

    async def _load(self) -> None:
        """Rebuild the mirror from what etcd holds now (at start, or after a compacted watch)."""
        revision, kvs = await self.etcd.get_prefix(self.keys.root)
        with self._half_applied():
            self.mirror.reset()  # the same mirror object: its waiters wake on what is loaded
            self._owners, self._meaning, self._vrev, self._leases, self._claims = {}, {}, {}, {}, {}
            for item in sorted(kvs, key=lambda k: k.mod_revision):  # relays join in the order they joined
                await self._put(item, revision)
            self._advance(revision)

    @contextlib.contextmanager
    def _half_applied(self) -> Iterator[None]:
        """Mark the mirror as being changed (a watch batch or a load: a version key applied before its manifest)."""
        self._applying += 1
        try:
            yield
        finally:
            self._applying -= 1

    def _advance(self, revision: int) -> None:
        if revision > self._applied:
            self._applied = revision
            self._advanced.set()
            self._advanced = asyncio.Event()

    async def _supervise(self) -> None:
        """Keep one watch running; ask it for progress every 0.5 s, and restart it on another member when it
        has said nothing (no event, no progress) for 2 s: a member cut off from the majority, or stuck."""
        while True:
            if self._watch is None or self._watch.done():
                self._heard = time.monotonic()
                self._watch = asyncio.create_task(self._follow())
            await asyncio.sleep(0.5)
            self._progress.put_nowait(None)
            if time.monotonic() - self._heard > 2.0:
                log.warning("registry (etcd): the watch on %s is silent (at revision %d); moving it",
                            self.etcd.current, self._applied)  # fmt: skip
                self._watch.cancel()
                with contextlib.suppress(BaseException):
                    await self._watch
                self.etcd.skip()
                self._watch = None

    async def _follow(self) -> None:
        self._progress = asyncio.Queue()
        try:
            async for _, events in self.etcd.watch(self.keys.root, self._applied + 1, self._progress):
                # a progress notification (no events) only says the watch is alive, never how far the mirror is:
                # etcd before 3.4.24 and 3.5.8 can send one ahead of events not yet sent (etcd-io/etcd#15220), and
                # a watch moved to another member restarts after the revision applied (an event skipped: lost)
                self._heard = time.monotonic()
                if events:
                    with self._half_applied():
                        for event in events:
                            item = KV.of(event.kv)
                            if event.type == kv.DELETE:
                                await self._delete(item.key)
                            else:
                                await self._put(item, item.mod_revision)
                        await self._announce()
                        self._advance(max(e.kv.mod_revision for e in events))
        except RevisionCompacted as exc:
            log.warning("registry (etcd): %s; reloading", exc)
            await self._load()
        except (TransportError, RefitTimeoutError) as exc:  # the watch, or a read it needed (a manifest's chunks)
            log.info("registry (etcd): %s; watching again from another member", exc)
            self.etcd.skip()
            await asyncio.sleep(0.1)

    async def _value(self, item: KV, revision: int) -> Any:
        doc = decode(item.value)
        if isinstance(doc, dict) and chunked(doc):
            _, chunks = await self.etcd.get_prefix(str(doc["prefix"]).encode(), revision=revision)
            doc = join_chunks(doc, [c.value for c in chunks])
        return doc

    async def _decode(self, d: dict[str, Any], rows: int, fn: Callable[[Any], Any]) -> Any:
        return fn(d) if rows <= _BIG else await anyio.to_thread.run_sync(fn, d, limiter=self._decoding)

    async def _put(self, item: KV, revision: int) -> None:
        kind, parts = self.keys.parse(item.key)
        try:
            if kind == "o":
                self._owners[parts[0]] = item.lease
                self._meaning[item.key] = ("o", Identity(model="-"), parts[0])
            elif kind == "m" and len(parts) == 2:
                doc = decode(item.value)
                identity = identity_from_dict(doc["identity"])
                self._vrev[(identity, int(doc["version"]))] = item.mod_revision
                self._meaning[item.key] = ("v", identity, int(doc["version"]))
            elif kind == "m":
                d = (await self._value(item, revision))["manifest"]
                manifest: Manifest = await self._decode(d, len(d.get("shards", ())), manifest_from_dict)
                self._leases[item.key] = item.lease
                self._meaning[item.key] = ("m", manifest.identity, (manifest.version, manifest.rank))
                self.mirror.record(manifest)
            elif kind == "c":
                doc = decode(item.value)
                claim = (identity_from_dict(doc["identity"]), int(doc["rank"]))
                self._claims[claim] = str(doc["owner"])
                self._meaning[item.key] = ("c", claim[0], claim[1])
            elif kind == "r":
                doc = decode(item.value)
                identity, rid = identity_from_dict(doc["identity"]), str(doc["receiver"])
                self._leases[item.key] = item.lease
                self._meaning[item.key] = ("r", identity, rid)
                await self.mirror.register_receiver(identity, rid)
                await self.mirror.report(identity, rid, int(doc["done"]))
            elif kind == "x":
                doc = await self._value(item, revision)
                identity, rid = identity_from_dict(doc["identity"]), str(doc["receiver"])
                self._meaning[item.key] = ("x", identity, rid)
                offer = None
                if doc["offer"] is not None:
                    offer = await self._decode(doc["offer"], len(doc["offer"].get("held", ())), offer_from_dict)
                outcome: Any
                try:
                    outcome = await self.mirror.relay_join(identity, int(doc["version"]), rid, layout=doc["layout"],
                                                           offer=offer)  # fmt: skip
                except (VersionError, ManifestError) as exc:
                    outcome = exc
                self._joined[(identity, rid)] = (item.mod_revision, outcome)
        except (KeyError, TypeError, ValueError, ManifestError) as exc:  # not ours, or damaged: never stop the watch
            log.warning("registry (etcd): ignoring %r: %s", item.key[:120], exc)

    async def _delete(self, key: bytes) -> None:
        meaning = self._meaning.pop(key, None)
        self._leases.pop(key, None)
        if meaning is None:
            return
        what, identity, detail = meaning
        if what == "o":
            self._owners.pop(detail, None)
        elif what == "c":
            self._claims.pop((identity, detail), None)
        elif what == "v":
            self._vrev.pop((identity, detail), None)
        elif what == "m":
            self.mirror.withdraw(identity, *detail)
        elif what == "r":
            await self.mirror.unregister_receiver(identity, detail)
        elif what == "x":
            await self.mirror.relay_leave(identity, detail)

    async def _announce(self) -> None:
        """Announce every identity whose newest complete or laid-out version changed."""
        for identity, model in list(self.mirror.models.items()):  # announcing awaits: a copy
            now = (model.newest, model.laid_out[-1] if model.laid_out else None)
            before = self._announced.get(identity, (None, None))
            if now == before:
                continue
            self._announced[identity] = now
            for version in {v for v, b in zip(now, before, strict=True) if v is not None and v != b}:
                if self.on_announce is not None:
                    await self.on_announce(identity_to_dict(identity), version)

    async def _caught_up(self, revision: int) -> None:
        """Wait until the mirror applied ``revision`` (this replica's own write, read back)."""
        try:
            with anyio.fail_after(self.etcd.op_timeout_s):
                while self._applied < revision:
                    await self._advanced.wait()
        except TimeoutError:
            raise RefitTimeoutError(f"etcd wrote revision {revision} but this replica's watch has not delivered it "
                                    f"within {self.etcd.op_timeout_s} s (at {self._applied})") from None  # fmt: skip

    async def _version_seen(self, identity: Identity, version: int, revision: int) -> None:
        """Wait (at most a call's deadline) until the mirror holds ``version``'s key at ``revision`` (0: none, as
        after the janitor deleted it): the version's manifests then are those etcd holds."""
        with anyio.move_on_after(self.etcd.op_timeout_s):  # changed again meanwhile: the next round loses anyway
            while self._applying or self._vrev.get((identity, version), 0) != revision:
                await self._advanced.wait()

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
        identity, version = manifest.identity, manifest.version
        vkey, mkey = self.keys.version(identity, version), self.keys.manifest(identity, version, manifest.rank)
        d = manifest_to_dict(manifest)
        head, chunks = await anyio.to_thread.run_sync(blob_value, mkey, {"manifest": d})
        vdoc = encode({"identity": identity_to_dict(identity), "version": version})
        ckey = self.keys.claim(identity, manifest.rank)
        cdoc = encode({"identity": identity_to_dict(identity), "rank": manifest.rank, "owner": owner})

        async def write(lease: int) -> None:
            for chunk_key, chunk in chunks:  # a large manifest: its chunks first (under the lease), then its head
                await self.etcd.txn([], [kv.put(chunk_key, chunk, lease)])
            # the first round compares with the mirror; a lost one with what etcd said the keys hold (the mirror
            # may lag: a claim whose lease ended is a deletion, and no key's revision tells of it)
            holder, seen = self._claims.get((identity, manifest.rank)), self._vrev.get((identity, version), 0)
            for _ in range(_CAS_TRIES):
                if owner is not None and holder not in (None, owner):
                    raise claimed(manifest, self.lease_s)
                if not self.mirror.admit(manifest):
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
        self, identity: Identity, version: int, receiver_id: str, *, layout: str = "", offer: RelayOffer | None = None
    ) -> RelayOffer | None:
        self.mirror.check_relay(identity, version, offer)
        key = self.keys.relay(identity, receiver_id)
        doc = {"identity": identity_to_dict(identity), "receiver": receiver_id, "version": version, "layout": layout,
               "offer": None if offer is None else offer_to_dict(offer)}  # fmt: skip
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

    # -- reads: the mirror ---------------------------------------------------------------------------

    def newest_complete(self, identity: Identity) -> int | None:
        return self.mirror.newest_complete(identity)

    def is_newest(self, identity: Identity, version: int) -> bool:
        return self.mirror.is_newest(identity, version)

    def announced(self, identity: Identity, version: int, rank: int) -> Manifest | None:
        return self.mirror.announced(identity, version, rank)

    async def latest(self, identity: Identity, min_version: int = 0, *, compile_targets: Collection[str] | None = None,
                     metadata: Mapping[str, str] | None = None, early: bool = False,
                     skip: Collection[int] = ()) -> Publication | None:  # fmt: skip
        return await self.mirror.latest(identity, min_version, compile_targets=compile_targets, metadata=metadata,
                                        early=early, skip=skip)  # fmt: skip

    async def wait_complete(self, identity: Identity, min_version: int, timeout: float, *,
                            compile_targets: Collection[str] | None = None, metadata: Mapping[str, str] | None = None,
                            early: bool = False, skip: Collection[int] = ()) -> Publication:  # fmt: skip
        return await self.mirror.wait_complete(identity, min_version, timeout, compile_targets=compile_targets,
                                               metadata=metadata, early=early, skip=skip)  # fmt: skip

    async def is_released(self, identity: Identity, version: int, *, policy: ReleasePolicy | None = None) -> bool:
        return await self.mirror.is_released(identity, version, policy=policy)

    async def acked(self, identity: Identity, version: int) -> tuple[int, int]:
        return await self.mirror.acked(identity, version)

    async def wait_released(self, identity: Identity, version: int, timeout: float | None, *,
                            policy: ReleasePolicy | None = None) -> None:  # fmt: skip
        await self.mirror.wait_released(identity, version, timeout, policy=policy)

    async def versions(self, identity: Identity) -> list[int]:
        return await self.mirror.versions(identity)

    async def relayed(self, identity: Identity) -> int | None:
        return await self.mirror.relayed(identity)

    async def near_misses(self, identity: Identity, min_version: int = 0) -> list[str]:
        return await self.mirror.near_misses(identity, min_version)
