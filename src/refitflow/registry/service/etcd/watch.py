"""How an etcd replica's mirror follows etcd: one watch, applied in revision order (``EtcdStore``'s half that
reads; the other half writes, ``etcd.store``).

Every key the watch delivers is applied to the mirror (an in-memory ``RegistryStore``) and remembered for its
deletion: owners' leases (``o/``), rank layouts (``l/``, each once), versions' keys and their compare-and-set
revisions (``m/…``), ranks' records (checked against their layout's size; their revisions were computed by the
replica that wrote them), rank claims (``c/``), receivers (``r/``) and relay joins by geometry (``x/``). Each
replica announces, from its watch, every version that became the newest complete (or laid-out) one. A watch
that fails, or says nothing for 2 s, is restarted on another member from the last revision applied (or the
mirror is loaded whole, if etcd compacted that history); how far the mirror is comes from the watch's events
alone (etcd-io/etcd#15220).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import anyio
import anyio.to_thread

from refitflow.core.errors import ManifestError, RefitTimeoutError, TransportError, VersionError
from refitflow.core.fanout import Relay, RelayLayouts
from refitflow.core.offers import geometry_from_dict, relay_from_dict
from refitflow.core.records import Announcement, RankLayout, fits, layout_from_dict, record_from_dict
from refitflow.core.types import Identity
from refitflow.core.wire import decode, source_from
from refitflow.registry.messages import identity_from_dict, identity_to_dict
from refitflow.registry.service.etcd import kv
from refitflow.registry.service.etcd.keys import Keys, chunked, join_chunks
from refitflow.registry.service.etcd.kv import KV, Etcd, RevisionCompacted
from refitflow.registry.service.store import RegistryStore

__all__ = ["Replication"]

log = logging.getLogger(__name__)

_BIG = 256  # shard specs (or held boxes) above which a value is decoded in a worker thread


def _layout(d: Any) -> RankLayout:
    return RankLayout(layout_from_dict(d))


def rows(value: Any) -> int:
    if isinstance(value, list):
        return len(value)
    count = value.get("count") if isinstance(value, dict) else None
    return count if type(count) is int else 0


class _MirrorKnows(RelayLayouts):
    """The mirror's relay geometries and addresses, as the wire form reads compact offers by them."""

    def __init__(self, mirror: RegistryStore) -> None:
        super().__init__()
        self.mirror = mirror

    def geometry(self, layout: str) -> Any:
        return self.mirror.relay_geometry(layout)

    def source(self, sid: str) -> Any:
        return self.mirror.relay_source(sid)


class Replication:
    """The mirror and what it was built from; ``EtcdStore`` sets these up and starts ``_supervise``."""

    etcd: Etcd
    keys: Keys
    mirror: RegistryStore
    on_announce: Callable[[dict[str, str], int], Awaitable[None]] | None
    _applied: int  # the revision the mirror has applied
    _applying: int  # > 0 while a watch batch (or a load) is half applied: a version key before its manifest
    _advanced: asyncio.Event
    _owners: dict[str, int]  # owner -> its lease (o/ keys)
    _meaning: dict[bytes, tuple[str, Identity, Any]]  # key -> what it holds (for its deletion)
    _vrev: dict[tuple[Identity, int], int]  # a version key's mod revision
    _leases: dict[bytes, int]  # manifest and receiver keys -> their lease
    _joined: dict[tuple[Identity, str], tuple[int, Any]]  # a relay join's revision and outcome
    _announced: dict[Identity, tuple[int | None, int | None]]
    _claims: dict[tuple[Identity, int], str]  # (identity, rank) -> the owner publishing it (c/ keys)
    _layout_keys: set[str]  # the layouts etcd holds (l/ keys)
    _carried: set[Any]  # relay geometries (layout digests) and addresses some x/ key carried whole
    _decoding: anyio.CapacityLimiter
    _watch: asyncio.Task[None] | None
    _progress: asyncio.Queue[None]  # progress requests to the watch
    _heard: float  # when the watch last said anything

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
            elif kind == "l":
                d = (await self._value(item, revision))["layout"]
                layout = await self._decode(d, rows(d.get("shards")), _layout)
                if layout.id != parts[0]:
                    raise ManifestError("a layout key holds another layout")
                self._layout_keys.add(layout.id)
                self._meaning[item.key] = ("l", layout.identity, layout.id)
                self.mirror.hold_layout(layout)
            elif kind == "m":
                record = record_from_dict((await self._value(item, revision))["record"])
                layout = self.mirror.layout(record.layout)
                if layout is None:
                    raise ManifestError(f"a record of a layout etcd does not hold ({record.layout[:12]})")
                fits(layout, record)  # checked by the replica that wrote it: its revision is not computed again
                self._leases[item.key] = item.lease
                self._meaning[item.key] = ("m", record.identity, (record.version, record.rank))
                self.mirror.record(Announcement.of_record(layout, record, None))
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
                outcome: Any
                try:
                    relay = await self._relay(doc)
                    keep = doc.get("keep")  # a join written before keep existed has none
                    outcome = await self.mirror.join_relays(identity, int(doc["version"]), rid, doc["layout"], relay,
                                                            None if keep is None else int(keep))  # fmt: skip
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
        elif what == "l":
            self._layout_keys.discard(detail)

    async def _relay(self, doc: dict[str, Any]) -> Relay | None:
        """A relay join's offer, by geometry (the geometry and the address whole the first time etcd has them)."""
        if doc["relay"] is None:
            return None
        if "geometry" in doc:
            d = doc["geometry"]
            layout, geometry = await self._decode(d, rows(d.get("held")), geometry_from_dict)
            if layout != doc["relay"]["layout"]:
                raise ManifestError("a relay join's geometry is of another layout")
            await self.mirror.add_relay_geometry(layout, geometry)
            self._carried.add(layout)
        if isinstance(doc["relay"]["source"], dict):
            self._carried.add(source_from(doc["relay"]["source"]))
        _, _, relay = relay_from_dict(doc["relay"], _MirrorKnows(self.mirror))
        await self.mirror.add_relay_source(relay.source)
        return relay

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
