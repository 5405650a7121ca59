"""Per-version costs outside the data path, measured here with refitflow's own code (``bench/simulate.py``).

For a scenario's publication, as built (a rank's layout sent and checked once; per version a record, and each
receiver its plan's part of the digests: ``core.records``, docs/registry.md):

- **registry**: what the registry service does with one version — each rank's record as the client sends it
  (``record_to_dict``: revision and raw digests) through the streaming frame decode
  (``registry.service.frames.decode_request``), ``record_from_dict``, the record's checks against its layout
  (``RegistryStore.entry_of``: its size, its revision recomputed) and the store's record (``publish_entry``) —
  on a sample of the ranks (their layouts held first, not timed), scaled to all of them. It runs in the
  registry's one process, one rank after the other;
- **fetch**: what each receiver does once per version to use it: the ``latest`` answer (each rank's revision and
  layout id: ``head_bytes`` on the wire) and its plan's part (8 bytes a digest its checks read, raw) decoded
  (``core.wire.decode``), every rank's layout manifest restamped (``core.records.restamp``) and the digest vector
  made (``fetch_s(part)``: a fixed part and one per digest fetched, measured on a part of 2^20 digests);
- **was**: what format 4 alone put on the wire per receiver — every rank's manifest, block digests in base64
  (``was_bytes``), for the tables' comparison.

Seconds are this machine's, one core each, the best of ``repeat`` passes (2 cores shared with other work:
the best pass is the nearest to what the code costs on an idle core).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import anyio
import numpy as np

import refitflow as rf
from refitflow.core.records import RankLayout, record_from_dict, record_of, record_to_dict, restamp
from refitflow.core.wire import PROTOCOL_VERSION, Blob, decode, encode, manifest_to_dict
from refitflow.registry.limits import RegistryLimits
from refitflow.registry.service.frames import decode_request
from refitflow.registry.service.store import RegistryStore

__all__ = ["Costs", "measure"]

_PROBE = 1 << 20  # digests of the part a receiver's vector is timed on


@dataclass(frozen=True)
class Costs:
    was_bytes: int  # the whole publication's manifests on the wire (format 4 alone: what every receiver fetched)
    head_bytes: int  # the ``latest`` answer a receiver fetches per version (no manifests)
    registry_s: float  # the registry's work to accept every rank's record of a version (serial)
    pending_s: float  # ... every rank's record announced before its digests (two-phase publication: no digests)
    decode_s: float  # one receiver's fixed work per version (the answer decoded, the layouts restamped)
    per_digest_s: float  # ... and per digest of its part (decoded, placed in its vector)
    sample: int  # ranks measured

    def fetch_s(self, part: int) -> float:
        """A receiver's decode of a version whose plan's part is ``part`` digests."""
        return self.decode_s + self.per_digest_s * part

    def wire_bytes(self, part: int) -> int:
        """What a receiver fetches per version: the answer and its part's digests."""
        return self.head_bytes + 8 * part + 200


def measure(pub: rf.Publication, sample: int = 8, repeat: int = 3) -> Costs:
    runs = [anyio.run(_measure, pub, sample) for _ in range(repeat)]
    best = lambda f: min(map(f, runs))  # noqa: E731
    return Costs(runs[0].was_bytes, runs[0].head_bytes, best(lambda c: c.registry_s), best(lambda c: c.pending_s),
                 best(lambda c: c.decode_s), best(lambda c: c.per_digest_s), runs[0].sample)  # fmt: skip


def _digested(m: rf.Manifest, seed: int) -> rf.Manifest:
    """``m`` with random digests (its own: a version's)."""
    rng = np.random.default_rng(seed)
    shards = []
    for s in m.shards:
        raw = rng.integers(0, 1 << 63, len(s.digest_bytes) // 8, dtype=np.uint64).astype(">u8").tobytes()
        shards.append(rf.ShardSpec(**{**vars(s), "digest": _xxh(raw) if s.tile_rows else raw.hex(),
                                      "blocks": _b64(raw) if s.tile_rows else ""}))  # fmt: skip
    return rf.Manifest(identity=m.identity, version=m.version + seed, rank=m.rank, world_size=m.world_size,
                       source=m.source, shards=tuple(shards), metadata=m.metadata)  # fmt: skip


def _xxh(raw: bytes) -> str:
    import xxhash

    return xxhash.xxh3_64_hexdigest(raw)


def _b64(raw: bytes) -> str:
    import base64

    return base64.b64encode(raw).decode()


async def _measure(pub: rf.Publication, sample: int) -> Costs:
    mans = pub.manifests
    step = max(1, len(mans) // sample)
    picked = list(mans[::step])[:sample]
    store = RegistryStore()
    for m in picked:  # the layouts, once (not a per-version cost)
        await store.publish(m)
    scale = len(mans) / len(picked)
    registry = await _accept_s(store, [_digested(m, 1) for m in picked]) * scale
    pending = await _accept_s(store, [_pending(m) for m in picked]) * scale  # the next version, announced early
    head = encode({"identity": {"model": pub.identity.model}, "version": 2, "revisions": ["0" * 32] * len(mans),
                   "layouts": ["0" * 32] * len(mans)})  # fmt: skip
    layouts = [store.layout_of(m).manifest for m in picked] * step
    t0 = time.perf_counter()
    found = decode(head)
    _ = [restamp(la, 2, r) for la, r in zip(layouts, found["revisions"], strict=False)]
    fixed = time.perf_counter() - t0
    used = np.unique(np.random.default_rng(0).integers(0, 8 * _PROBE, _PROBE))
    reply = encode({"part": "0" * 32, "digests": Blob(bytes(8 * len(used)))})
    t0 = time.perf_counter()
    got = np.frombuffer(decode(reply)["digests"], dtype=">u8")
    vector = np.zeros(8 * _PROBE, dtype=np.uint64)
    vector[used] = got
    per_digest = (time.perf_counter() - t0) / len(used)
    was = sum(len(encode(manifest_to_dict(m))) for m in mans)
    return Costs(was, len(head), registry, pending, fixed, per_digest, len(picked))


def _pending(m: rf.Manifest) -> rf.Manifest:
    """``m``'s next-but-one version announced before its digests (the publisher's auto mode when every byte
    changed: receivers that read only the trainer start once the registry took these)."""
    shards = tuple(rf.ShardSpec(**{**vars(s), "digest": "", "blocks": ""}) for s in m.shards)
    return rf.Manifest(identity=m.identity, version=m.version + 2, rank=m.rank, world_size=m.world_size,
                       source=m.source, shards=shards, metadata=m.metadata)  # fmt: skip


async def _accept_s(store: RegistryStore, later: list[rf.Manifest]) -> float:
    """The registry's work on these ranks' records (their layouts held), each as the client sends it: seconds."""
    records = [record_to_dict(record_of(m, RankLayout.id_of(m))) for m in later]  # what the client sends
    frames = [encode({"v": PROTOCOL_VERSION, "id": i, "op": "publish", "owner": "sim", "record": r})
              for i, r in enumerate(records)]  # fmt: skip
    limits = RegistryLimits()
    t0 = time.perf_counter()
    for f in frames:
        msg = await decode_request(f, limits.max_shards)
        await store.publish_entry(store.entry_of(record_from_dict(msg["record"])), owner="sim")
    return time.perf_counter() - t0
