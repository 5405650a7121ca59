"""A rank's publication in two parts: its *layout*, sent and checked once, and per version a small *record*.

A manifest is mostly layout — the identity, rank and world, metadata, source address and every shard's
name, dtype, shape, range, region, offset and digest geometry — and that is the same from one version to the
next; only its digests (and revision) change. So on the wire (added to format 4; whole manifests mean what they
meant):

- **layout** (``layout_to_dict``): the manifest without version, revision or digests: shard columns of
  ``LAYOUT_FIELDS``. Its id is the BLAKE2b-128 of its canonical bytes (``RankLayout``): whoever checked a layout
  names it by an id it computed itself, so an id a peer sends can only refer to what was checked.
- **record** (``record_to_dict``): identity, version, rank, the layout's id, the revision, and the digests as
  one blob of raw bytes (``core.wire.Blob``): every shard's digests, 8 bytes each, big-endian, in shard order —
  the rank's *digest vector*; each shard's own ``digest`` is derived (xxh3_64 of its block digests, or its one
  digest). A pending record (two-phase publication) has no digests and revision "".

A record is checked against its layout: its size (8 × the layout's digest count) before anything is read, then
its revision recomputed from the digests (``RankLayout.revision``: the very value ``revision_of`` gives the
manifest, from a template made once per layout). ``materialise`` gives the whole ``Manifest`` back, equal to
the publisher's.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
import orjson
import xxhash

from refitflow.core.columns import DIGESTS, FIELDS, shards_to_columns
from refitflow.core.errors import ManifestError, RefitError
from refitflow.core.types import MAX_INT, Identity, Manifest, Publication, ShardSpec, SourceAddress
from refitflow.core.wire import PROTOCOL_VERSION, Blob, check_format, identity_dict, manifest_from_dict, source_dict

__all__ = [
    "LAYOUT_FIELDS",
    "Announcement",
    "Outline",
    "RankLayout",
    "RankRecord",
    "layout_from_dict",
    "layout_to_dict",
    "materialise",
    "record_from_dict",
    "record_of",
    "record_to_dict",
    "restamp",
]

LAYOUT_FIELDS = tuple(f for f in FIELDS if f not in DIGESTS)
_LAYOUT_KEYS = {"format", "identity", "rank", "world_size", "layout_digest", "metadata", "source", "shards"}
_RECORD_KEYS = {"format", "identity", "version", "rank", "layout", "revision", "digests"}


def layout_to_dict(m: Manifest) -> dict[str, Any]:
    """``m``'s layout as the wire carries it (whatever its digests: they are left out)."""
    return {"format": PROTOCOL_VERSION, "identity": identity_dict(m.identity), "rank": m.rank,
            "world_size": m.world_size, "layout_digest": m.layout_digest, "metadata": m.metadata,
            "source": source_dict(m.source), "shards": shards_to_columns(m.shards, LAYOUT_FIELDS)}  # fmt: skip


def layout_from_dict(d: Any) -> Manifest:
    """A layout, checked as a manifest is (``manifest_from_dict``), as the pending manifest it is (version 0)."""
    if not isinstance(d, dict) or set(d) != _LAYOUT_KEYS:
        raise ManifestError(f"a layout is an object of {sorted(_LAYOUT_KEYS)}")
    check_format(d)
    shards = d["shards"]
    if not isinstance(shards, dict) or not isinstance(shards.get("same"), dict) or not isinstance(
            shards.get("each"), dict) or (set(shards["same"]) | set(shards["each"])) & set(DIGESTS):  # fmt: skip
        raise ManifestError("a layout's shards: columns of the layout fields alone (no digests)")
    pending = {**shards, "same": {**shards["same"], "digest": "", "blocks": ""}}
    return manifest_from_dict({**d, "version": 0, "revision": "", "shards": pending})


class RankLayout:
    """A rank's layout, checked: the pending manifest, its canonical bytes and id, where each shard's digests lie."""

    def __init__(self, manifest: Manifest, encoded: bytes | None = None) -> None:
        self.manifest = manifest  # the pending form (version 0): the geometry, the source, the metadata
        self.encoded = orjson.dumps(layout_to_dict(manifest)) if encoded is None else encoded
        self.id = hashlib.blake2b(self.encoded, digest_size=16).hexdigest()
        counts = np.fromiter((s.tiling.count for s in manifest.shards), dtype=np.int64, count=len(manifest.shards))
        self.offsets = np.concatenate([[0], np.cumsum(counts)])  # shard i's digests: [offsets[i], offsets[i + 1])
        self.count = int(self.offsets[-1])

    @staticmethod
    def id_of(m: Manifest) -> str:
        """The id ``m``'s layout has (computed as a ``RankLayout`` computes it, without building one)."""
        return hashlib.blake2b(orjson.dumps(layout_to_dict(m)), digest_size=16).hexdigest()

    @classmethod
    def of_checked(cls, m: Manifest, encoded: bytes | None = None) -> RankLayout:
        """The layout of ``m``, a manifest already checked (made here, or by ``manifest_from_dict``): its specs
        without digests, not checked again; ``encoded``: its layout's bytes, if made already."""
        new, setattr_ = object.__new__, object.__setattr__
        shards = []
        for spec in m.shards:
            fields = dict(vars(spec))
            fields["digest"], fields["blocks"] = "", ""
            s = new(ShardSpec)
            setattr_(s, "__dict__", fields)
            shards.append(s)
        pending = new(Manifest)
        vars(pending).update(identity=m.identity, version=0, rank=m.rank, world_size=m.world_size, source=m.source,
                             shards=tuple(shards), revision="", metadata=dict(m.metadata),
                             layout_digest=m.layout_digest)  # fmt: skip
        return cls(pending, encoded)

    @property
    def identity(self) -> Identity:
        return self.manifest.identity

    @property
    def rank(self) -> int:
        return self.manifest.rank

    @cached_property
    def _template(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``revision_of``'s input with every digest "0…0", where each digest's hex goes, and the tiled shards."""
        items = [orjson.dumps([s.name, s.dtype, s.global_shape, s.axis, s.start, s.stop, "0" * 16])
                 for s in self.manifest.shards]  # fmt: skip
        ends = np.cumsum([len(i) + 1 for i in items])  # each item and the "," (or "[") before it
        starts = ends - 18  # '"' + 16 hex digits + '"]' end each item
        template = np.frombuffer(b"[" + b",".join(items) + b"]", dtype=np.uint8)
        tiled = np.array([s.tile_rows > 0 for s in self.manifest.shards], dtype=bool)
        return template, starts[:, None] + np.arange(16), tiled

    def shard_digests(self, raw: bytes | memoryview) -> np.ndarray:
        """Each shard's own digest (uint64) from the rank's digest vector: xxh3_64 of its block digests, or its
        one digest."""
        _, _, tiled = self._template
        vector = np.frombuffer(raw, dtype=">u8")
        out = vector[self.offsets[:-1]].astype(np.uint64)
        view, at = memoryview(raw), (self.offsets * 8).tolist()
        h = xxhash.xxh3_64_intdigest
        for i in np.flatnonzero(tiled).tolist():
            out[i] = h(view[at[i] : at[i + 1]])
        return out

    def revision(self, raw: bytes | memoryview) -> tuple[str, np.ndarray]:
        """The revision a manifest of this layout with digests ``raw`` has, and its shards' own digests."""
        template, where, _ = self._template
        digests = self.shard_digests(raw)
        hexes = np.frombuffer(binascii.hexlify(digests.astype(">u8").tobytes()), dtype=np.uint8)
        text = template.copy()
        text[where] = hexes.reshape(-1, 16)
        return xxhash.xxh3_128_hexdigest(text.data), digests


@dataclass(frozen=True, kw_only=True, eq=False)
class RankRecord:
    """One rank's announcement of one version: its layout's id, revision and digests (None: pending)."""

    identity: Identity
    version: int
    rank: int
    layout: str
    revision: str
    digests: bytes | memoryview | None

    @property
    def pending(self) -> bool:
        return self.digests is None


def record_to_dict(r: RankRecord) -> dict[str, Any]:
    d = {"format": PROTOCOL_VERSION, "identity": identity_dict(r.identity), "version": r.version, "rank": r.rank,
         "layout": r.layout, "revision": r.revision}  # fmt: skip
    return d if r.digests is None else {**d, "digests": Blob(r.digests)}


def _int(value: Any, what: str) -> int:
    if type(value) is not int or not 0 <= value <= MAX_INT:
        raise ManifestError(f"a record's {what} is an integer in [0, 2**63), got {value!r:.40}")
    return value


def record_from_dict(d: Any) -> RankRecord:
    """A record's fields, each of its type (its digests and revision are checked against its layout: ``check``)."""
    if not isinstance(d, dict) or not set(d) <= _RECORD_KEYS or not _RECORD_KEYS - {"digests"} <= set(d):
        raise ManifestError(f"a record is an object of {sorted(_RECORD_KEYS)} (digests: absent when pending)")
    check_format(d)
    identity, layout, revision, digests = d["identity"], d["layout"], d["revision"], d.get("digests")
    if not isinstance(identity, dict) or not all(type(v) is str for v in identity.values()):
        raise ManifestError("a record's identity is an object of strings")
    if type(layout) is not str or len(layout) != 32 or type(revision) is not str or len(revision) not in (0, 32):
        raise ManifestError("a record names its layout (32 hex digits) and revision (32, or none: pending)")
    if digests is not None and not isinstance(digests, memoryview | bytes):
        raise ManifestError("a record's digests are a blob of bytes")
    if (digests is None) != (revision == ""):
        raise ManifestError("a record's digests and revision go together (neither: pending)")
    try:
        ident = Identity(**identity)
    except (TypeError, RefitError) as exc:
        raise ManifestError(f"a record's identity: {exc}") from None
    return RankRecord(identity=ident, version=_int(d["version"], "version"), rank=_int(d["rank"], "rank"),
                      layout=layout, revision=revision, digests=digests)  # fmt: skip


def fits(layout: RankLayout, record: RankRecord) -> None:
    """Refuse ``record`` unless it is of ``layout``'s identity and rank, and of its size (nothing read yet)."""
    m = layout.manifest
    if record.identity != m.identity or record.rank != m.rank or record.layout != layout.id:
        raise ManifestError("a record names another rank's layout", version=record.version)
    if record.digests is not None and len(record.digests) != 8 * layout.count:  # counted before anything is read
        raise ManifestError(f"{len(record.digests)} bytes of digests for a layout of {layout.count} digests",
                            version=record.version)  # fmt: skip


def check(layout: RankLayout, record: RankRecord) -> np.ndarray | None:
    """Refuse ``record`` unless it fits ``layout`` (``fits``) and its revision is its digests'; the shards' own
    digests (None: pending)."""
    fits(layout, record)
    if record.digests is None:
        return None
    revision, digests = layout.revision(record.digests)
    if revision != record.revision:
        raise ManifestError("revision does not match the shard digests", version=record.version)
    return digests


check_record = check
__all__ += ["check_record", "fits"]


def record_of(m: Manifest, layout: str) -> RankRecord:
    """``m``'s record (its layout's id given): its digests as the rank's digest vector."""
    digests = None if m.pending else m.digest_blob
    return RankRecord(identity=m.identity, version=m.version, rank=m.rank, layout=layout, revision=m.revision,
                      digests=digests)  # fmt: skip


def materialise(layout: RankLayout, record: RankRecord, digests: np.ndarray | None = None) -> Manifest:
    """The whole manifest of ``layout`` at ``record`` (both checked: nothing is checked again), equal to the one
    its publisher made. ``digests``: the shards' own, if known (``check`` gave them)."""
    base = layout.manifest
    shards: tuple[ShardSpec, ...] = base.shards
    if record.digests is not None:
        if digests is None:
            digests = layout.shard_digests(record.digests)
        hexes = binascii.hexlify(digests.astype(">u8").tobytes()).decode()
        raw, at = bytes(record.digests), (layout.offsets * 8).tolist()
        new, setattr_ = object.__new__, object.__setattr__
        out = []
        for i, spec in enumerate(shards):
            fields = dict(vars(spec))
            fields["digest"] = hexes[16 * i : 16 * i + 16]
            fields["blocks"] = base64.b64encode(raw[at[i] : at[i + 1]]).decode() if spec.tile_rows else ""
            s = new(ShardSpec)
            setattr_(s, "__dict__", fields)
            out.append(s)
        shards = tuple(out)
    m = object.__new__(Manifest)
    vars(m).update(identity=base.identity, version=record.version, rank=base.rank, world_size=base.world_size,
                   source=base.source, shards=shards, revision=record.revision, metadata=dict(base.metadata),
                   layout_digest=base.layout_digest)  # fmt: skip
    if record.digests is not None:
        vars(m)["digest_blob"] = bytes(record.digests)  # ``Manifest.digest_blob``, as the record carries it
    return m


class Announcement:
    """One rank's announcement of one version as a store holds it: its layout (checked once, shared by every
    version of that layout) and the version's record — revision and digest vector. The whole manifest is made only
    when asked for (``manifest``); an announcement made from a manifest in this process keeps that object, and
    makes its digest vector only when asked for it (``raw``)."""

    __slots__ = ("_digests", "_manifest", "_raw", "layout", "revision", "version")

    def __init__(self, layout: RankLayout, version: int, revision: str, raw: bytes | memoryview | None, *,
                 manifest: Manifest | None = None, digests: np.ndarray | None = None) -> None:  # fmt: skip
        self.layout, self.version, self.revision = layout, version, revision
        self._raw, self._manifest, self._digests = raw, manifest, digests

    @classmethod
    def of_record(cls, layout: RankLayout, record: RankRecord, digests: np.ndarray | None) -> Announcement:
        return cls(layout, record.version, record.revision, record.digests, digests=digests)

    @property
    def pending(self) -> bool:
        return not self.revision

    @property
    def identity(self) -> Identity:
        return self.layout.manifest.identity

    @property
    def rank(self) -> int:
        return self.layout.manifest.rank

    @property
    def world_size(self) -> int:
        return self.layout.manifest.world_size

    @property
    def metadata(self) -> dict[str, str]:
        return self.layout.manifest.metadata

    @property
    def source(self) -> SourceAddress:
        return self.layout.manifest.source

    @property
    def raw(self) -> bytes | memoryview | None:
        """The rank's digest vector (8 bytes a digest, big-endian, shard after shard); None while pending."""
        if self._raw is None and self._manifest is not None and not self.pending:
            self._raw = self._manifest.digest_blob
        return self._raw

    @property
    def manifest(self) -> Manifest:
        """The whole manifest (made on first use)."""
        if self._manifest is None:
            record = RankRecord(identity=self.identity, version=self.version, rank=self.rank, layout=self.layout.id,
                                revision=self.revision, digests=self._raw)  # fmt: skip
            self._manifest = materialise(self.layout, record, self._digests)
        return self._manifest

    def same_geometry(self, other: Announcement) -> bool:
        """Whether both announce the same shards (their sources may differ: a publisher's new address)."""
        return self.layout is other.layout or self.layout.manifest.shards == other.layout.manifest.shards

    def __repr__(self) -> str:
        state: Any = "pending" if self.pending else self.revision[:8]
        return f"Announcement(rank {self.rank}, version {self.version}, layout {self.layout.id[:8]}, {state})"


def restamp(layout: Manifest, version: int, revision: str) -> Manifest:
    """A rank layout's manifest at ``version`` (its shards still without digests: an ``Outline``'s), O(1)."""
    m = object.__new__(Manifest)
    vars(m).update(vars(layout))
    vars(m).update(version=version, revision=revision)
    return m


DigestFetch = Callable[[Sequence[tuple[int, int, Any]], int, "np.ndarray | None"], Awaitable[np.ndarray]]


@dataclass(frozen=True, kw_only=True)
class Outline(Publication):
    """A publication as a receiver needs it per version: every rank's layout at this version (manifests whose shards
    carry no digests) and revision, and ``digests`` for a plan's part of the digests — fetched alone, not the
    publication's. A plan is made from the layouts (fetched once each); ``Plan.digests`` is not for an outline."""

    revisions: tuple[str, ...]
    fetch: DigestFetch = field(compare=False, repr=False)

    @property
    def pending(self) -> bool:
        return not all(self.revisions)

    @property
    def revision(self) -> str:
        h = xxhash.xxh3_128()
        for r in self.revisions:
            h.update(r.encode())
        return h.hexdigest()

    async def digests(self, order: Sequence[tuple[int, int, Any]], count: int, used: np.ndarray | None = None
                      ) -> np.ndarray:  # fmt: skip
        """The digest vector of a plan that reads, in ``order`` (``DigestIndex.order``: source, position, place),
        ``count`` digests — native uint64; ``used`` (sorted vector indices): only those are fetched, the others 0."""
        return await self.fetch(order, count, used)
