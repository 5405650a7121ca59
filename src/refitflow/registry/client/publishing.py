"""How a registry client announces a rank's manifest: a layout once, then per version a small record.

The first manifest of a layout goes whole (``publish`` with ``manifest``: the registry holds its layout from
then on, under the id both sides compute from its canonical bytes, ``core.records.RankLayout``). Every later
manifest of that layout goes as its record — revision and digests, raw — and the digests of a manifest this
client announced pending (two-phase publication) go alone (``complete``). A registry that does not hold the
layout (restarted, another replica, or it dropped it) says so, and gets the whole manifest: one more round
trip. Digests written in upper-case hexadecimal (not refitflow's) go as text, whole, as before.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from refitflow.core.errors import ManifestError, RefitTimeoutError, VersionError
from refitflow.core.records import RankLayout, record_of, record_to_dict
from refitflow.core.types import Manifest
from refitflow.core.wire import UNKNOWN_LAYOUT, Blob, digests_to_dict, manifest_to_dict
from refitflow.registry.client.upkeep import Upkeep
from refitflow.registry.messages import CLAIMED, identity_to_dict

__all__ = ["Announcing"]

log = logging.getLogger(__name__)

_BIG = 1000  # shards above which a manifest's layout id and record are made in a worker thread


def _canonical(m: Manifest) -> bool:
    """Whether ``m``'s digests are as the raw form gives them back (lower-case hexadecimal)."""
    joined = "".join([s.digest for s in m.shards])
    return joined == joined.lower()


class Announcing:
    def __init__(self, request: Callable[..., Awaitable[Any]], hello: Callable[[], Awaitable[dict[str, Any]]],
                 upkeep: Upkeep, client_id: str) -> None:  # fmt: skip
        self._request, self._hello, self._upkeep, self.client_id = request, hello, upkeep, client_id
        self.layouts: set[str] = set()  # the layouts this client sent whole to the registry (it holds them)

    async def publish(self, manifest: Manifest) -> None:
        hello = await self._hello()
        max_bytes = hello.get("max_message_bytes")
        loop = asyncio.get_running_loop()
        give_up = loop.time() + float(hello.get("lease_s", 10.0)) + 1.0
        big = len(manifest.shards) > _BIG
        try:
            if self._completes(manifest):
                try:
                    await self._complete(manifest, max_bytes)
                    self._upkeep.hold(manifest)
                    return
                except VersionError as exc:
                    log.info("registry client: digests alone refused (%s); publishing the whole manifest", exc.reason)
            lid = await asyncio.to_thread(RankLayout.id_of, manifest) if big else RankLayout.id_of(manifest)
            compact = lid in self.layouts and _canonical(manifest)
            while True:
                try:
                    if compact:
                        record = await asyncio.to_thread(record_of, manifest, lid) if big else record_of(manifest, lid)
                        await self._request("publish", record=record_to_dict(record), owner=self.client_id,
                                            max_bytes=max_bytes)  # fmt: skip
                    else:
                        await self._request("publish", manifest=manifest_to_dict(manifest), owner=self.client_id,
                                            max_bytes=max_bytes)  # fmt: skip
                        self.layouts.add(lid)
                    break
                except ManifestError as exc:
                    if not compact or UNKNOWN_LAYOUT not in exc.reason:
                        raise
                    self.layouts.discard(lid)
                    compact = False
                except VersionError as exc:
                    if CLAIMED not in exc.reason or loop.time() >= give_up:
                        raise
                    log.info("registry client: rank %d is still another client's; asking again", manifest.rank)
                    await asyncio.sleep(0.25)
        except RefitTimeoutError as exc:
            self._upkeep.hold(manifest)
            self._upkeep.stale = True  # announce what is held once the registry answers
            raise RefitTimeoutError(f"{exc.reason}; version {manifest.version} is held and will be announced when "
                                    "the registry answers again", version=manifest.version) from exc  # fmt: skip
        self._upkeep.hold(manifest)

    async def _complete(self, manifest: Manifest, max_bytes: Any) -> None:
        """The digests of a manifest announced pending, alone: raw, or as text columns when not canonical."""
        ask = {"identity": identity_to_dict(manifest.identity), "version": manifest.version, "rank": manifest.rank,
               "owner": self.client_id, "max_bytes": max_bytes}  # fmt: skip
        if _canonical(manifest):
            raw = manifest.digest_blob
            await self._request("complete", revision=manifest.revision, digests=Blob(raw), **ask)
        else:
            await self._request("complete", digests=digests_to_dict(manifest), **ask)

    def _completes(self, manifest: Manifest) -> bool:
        """Whether ``manifest`` holds the digests of the pending manifest this client announced for its rank and
        version (``Manifest.completes``: the same head and layout, ≈ 0.5 µs a shard)."""
        held = self._upkeep.announced(manifest)
        return held is not None and manifest.completes(held)
