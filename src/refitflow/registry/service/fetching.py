"""What receivers fetch, each piece encoded once and served as it is to every receiver that asks for it.

- ``latest``: the version found, its ranks' revisions and layout ids (no manifests).
- ``layouts``: rank layouts by id, as the canonical bytes they were checked as (``core.records``): a receiver
  fetches each layout once, to plan, and checks that the bytes give the id it asked for.
- ``part``: a plan's part of a version's digests (``parts``): registered once, then by id, gathered once per
  version, raw.
- ``publication``: every rank's digest vector (the whole publication, for a client's ``latest``: its manifests
  made from the layouts it holds).
- ``manifests``: every rank's whole manifest, as format 4 had it (each encoded once, for every asker).
"""

from __future__ import annotations

import weakref
from typing import Any

import anyio
import orjson

from refitflow.core.errors import ManifestError, VersionError
from refitflow.core.records import Announcement
from refitflow.core.types import Manifest
from refitflow.core.wire import Blob, encode, manifest_to_dict
from refitflow.registry.messages import identity_from_dict, identity_to_dict
from refitflow.registry.protocol import Store
from refitflow.registry.service.args import arg, filters, off_loop_if
from refitflow.registry.service.parts import Parts

__all__ = ["MAX_LAYOUTS", "FetchOps"]

MAX_LAYOUTS = 4096  # layouts one request may ask for
WIRE_CACHE = 256  # whole manifests kept encoded for the next ``manifests`` fetch


class FetchOps:
    registry: Store
    _checking: anyio.CapacityLimiter
    _parts: Parts
    _wire: dict[int, tuple[weakref.ref[Manifest], orjson.Fragment]]  # id -> (manifest, its bytes)

    def _entries(self, msg: dict[str, Any]) -> tuple[Announcement, ...]:
        identity = identity_from_dict(arg(msg, "identity", dict))
        version = arg(msg, "version", int)
        found = self.registry.find(identity, version, early=arg(msg, "early", bool, False))
        if found is None or found[1] != version:
            raise VersionError("no longer offered (superseded, released or its publisher's lease expired)",
                               version=version)  # fmt: skip
        return found[2]

    async def op_latest(self, msg: dict[str, Any]) -> Any:
        identity = identity_from_dict(arg(msg, "identity", dict))
        found = self.registry.find(identity, arg(msg, "min_version", int, 0), **filters(msg))
        if found is None:
            return None
        ident, version, entries = found
        return {"identity": identity_to_dict(ident), "version": version,
                "revisions": [e.revision for e in entries], "layouts": [e.layout.id for e in entries]}  # fmt: skip

    async def op_layouts(self, msg: dict[str, Any]) -> Any:
        ids = arg(msg, "ids", list)
        if len(ids) > MAX_LAYOUTS or not all(type(i) is str for i in ids):
            raise ManifestError(f"layouts: at most {MAX_LAYOUTS} ids")
        out = []
        for i in ids:
            layout = self.registry.layout(i)
            if layout is None:
                raise VersionError(f"layout {i:.12} is not held here (the version was dropped): ask again")
            out.append(orjson.Fragment(layout.encoded))
        return out

    async def op_publication(self, msg: dict[str, Any]) -> Any:
        entries = self._entries(msg)
        if any(e.raw is None and not e.pending for e in entries):
            raise VersionError("a rank's digests are not held", version=entries[0].version)
        return {"revisions": [e.revision for e in entries], "layouts": [e.layout.id for e in entries],
                "digests": [None if e.raw is None else Blob(e.raw) for e in entries]}  # fmt: skip

    async def op_part(self, msg: dict[str, Any]) -> Any:
        """A plan's part of a version's digests: by ``id`` once registered, else registered from ``layouts`` and
        ``runs`` (``parts``); ``ManifestError`` (unknown) for an id not held here (the client sends the part)."""
        entries = self._entries(msg)
        if "runs" in msg:
            runs = msg["runs"]
            if not isinstance(runs, memoryview):
                raise ManifestError("a part's runs are a blob of int64 triples")
            big = len(runs) > 24 * 4096
            part = await off_loop_if(big, self._checking, self._parts.register, arg(msg, "layouts", list), runs,
                                     entries)  # fmt: skip
        else:
            part = self._parts.get(arg(msg, "part", str))
        data = await off_loop_if(part.count > 1 << 16, self._checking, self._parts.gather, part, entries)
        return {"part": part.id, "digests": Blob(data)}

    async def op_manifests(self, msg: dict[str, Any]) -> Any:
        return [self._encoded(e.manifest) for e in self._entries(msg)]

    def _encoded(self, manifest: Manifest) -> orjson.Fragment:
        """``manifest`` as the reply carries it, encoded once for every receiver that fetches it: an LRU of the
        last ``WIRE_CACHE`` manifests served, each entry its bytes and a weak reference to the very object it
        encoded (a manifest the store dropped is not kept alive, and an equal one is not taken for it)."""
        hit = self._wire.pop(id(manifest), None)
        if hit is None or hit[0]() is not manifest:
            hit = (weakref.ref(manifest), orjson.Fragment(encode(manifest_to_dict(manifest))))
            while len(self._wire) >= WIRE_CACHE:
                del self._wire[next(iter(self._wire))]
        self._wire[id(manifest)] = hit
        return hit[1]
