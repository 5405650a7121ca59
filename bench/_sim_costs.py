"""Per-version costs outside the data path, measured here with refitflow's own code (``bench/simulate.py``).

For a scenario's publication:

- **wire**: the bytes of its manifests as the registry protocol writes them (``core.wire``: orjson of
  ``manifest_to_dict``), block digests included (base64: 8 bytes a tile);
- **registry**: what the registry service does with one publish request, per byte of request: the
  streaming frame decode (``registry.service.frames.decode_request``), ``manifest_from_dict``, the store's
  checks and record (``RegistryStore.publish``) — on a sample of the ranks, scaled to all of them. It runs
  in the registry's one process, one rank after the other;
- **fetch**: what each receiver does once per version to use it: decode the manifests
  (``core.wire.decode`` + ``manifest_from_dict``, as ``registry.client.fetched``) and its digest vector
  (``stages._checks.digest_vector``, in the plan stage: the digests of the shards it reads) — on the same
  sample, scaled; the digests measured for every shard (``digests_s``), a rank decodes its share of them.

Seconds are this machine's, one core each, the best of ``repeat`` passes (2 cores shared with other work:
the best pass is the nearest to what the code costs on an idle core).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import anyio

import refitflow as rf
from refitflow.core.wire import PROTOCOL_VERSION, decode, encode, manifest_from_dict, manifest_to_dict
from refitflow.planner.checks import digest_vector, every_shard
from refitflow.registry.limits import RegistryLimits
from refitflow.registry.service.frames import decode_request
from refitflow.registry.service.store import RegistryStore

__all__ = ["Costs", "measure"]


@dataclass(frozen=True)
class Costs:
    wire_bytes: int  # the whole publication's manifests on the wire
    registry_s: float  # the registry's work to accept every rank's manifest (serial)
    decode_s: float  # one receiver's work to decode the publication's manifests
    digests_s: float  # ... and the digests of every shard (a rank decodes those of the shards it reads)
    sample: int  # manifests measured

    def fetch_s(self, share: float) -> float:
        """A receiver's decode of a version, reading shards that hold ``share`` of the digests."""
        return self.decode_s + self.digests_s * share


def measure(pub: rf.Publication, sample: int = 8, repeat: int = 3) -> Costs:
    runs = [anyio.run(_measure, pub, sample) for _ in range(repeat)]
    best = lambda f: min(map(f, runs))  # noqa: E731
    return Costs(runs[0].wire_bytes, best(lambda c: c.registry_s), best(lambda c: c.decode_s),
                 best(lambda c: c.digests_s), runs[0].sample)  # fmt: skip


async def _measure(pub: rf.Publication, sample: int) -> Costs:
    mans = pub.manifests
    step = max(1, len(mans) // sample)
    picked = list(mans[::step])[:sample]
    frames = [encode({"v": PROTOCOL_VERSION, "id": i, "op": "publish", "manifest": manifest_to_dict(m),
                      "owner": "sim"}) for i, m in enumerate(picked)]  # fmt: skip
    limits = RegistryLimits()
    store = RegistryStore()
    t0 = time.perf_counter()
    for f in frames:
        msg = await decode_request(f, limits.max_shards)
        await store.publish(manifest_from_dict(msg["manifest"]), owner="sim")
    registry = time.perf_counter() - t0
    replies = [encode(manifest_to_dict(m)) for m in picked]
    t0 = time.perf_counter()
    decoded = tuple(manifest_from_dict(decode(r)) for r in replies)
    fetch = time.perf_counter() - t0
    fetched = rf.Publication(identity=pub.identity, version=pub.version, manifests=decoded)
    every, count = every_shard(fetched)
    t0 = time.perf_counter()
    digest_vector(fetched, every, count)
    digests = time.perf_counter() - t0
    sampled = sum(len(f) for f in frames)
    total = sum(len(encode(manifest_to_dict(m))) for m in mans) if len(mans) > len(picked) else sampled
    scale = total / sampled
    return Costs(total, registry * scale, fetch * scale, digests * scale, len(picked))
