"""What a registry client fetched of publications: rank layouts once each, whole publications once per version,
and per version the part of the digests a receiver's plan reads.

``latest`` answers with a version, its ranks' revisions and layout ids only. Then:

- **layouts** (``layouts``): fetched once per id (an LRU of ``LAYOUTS``), each checked as a manifest is and held
  to the id asked for (its canonical bytes must give it): a registry cannot hand a receiver another layout.
- **outline** (``outline``): the version as a receiver plans and reads it — every rank's layout at this version, no
  digests — with ``Outline.digests`` fetching a plan's part: the part (per rank, runs of digest indices) is sent
  once and then named by its id; per version only its digests travel, raw. A plan's order is checked once
  against the layouts it is applied to (each shard where, and what, the plan read it as).
- **whole** (``get``): every rank's digests too, each manifest made whole (``core.records.materialise``): what
  ``latest`` and ``wait_complete`` return. One fetch per (identity, version, revisions); concurrent askers share it.

A version announced before its digests has revisions "": fetched each time it is asked for while laid out
(never kept), then once complete.
"""

from __future__ import annotations

import asyncio
import hashlib
import operator
import weakref
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import Any

import numpy as np
import orjson

from refitflow.core.errors import ManifestError, VersionError
from refitflow.core.records import (
    Outline,
    RankLayout,
    RankRecord,
    check_record,
    layout_from_dict,
    materialise,
    restamp,
)
from refitflow.core.types import TILING_FIELDS, Identity, Manifest, Publication
from refitflow.core.wire import UNKNOWN_LAYOUT, Blob
from refitflow.registry.messages import identity_from_dict, identity_to_dict

__all__ = ["Fetched"]

LAYOUTS = 4096  # rank layouts kept
_PLACE = operator.attrgetter("name", *TILING_FIELDS)  # a shard's name and digest geometry (what a plan placed)
_PARTS = 8  # plans whose parts are kept


_CHECKED: weakref.WeakValueDictionary[str, RankLayout] = weakref.WeakValueDictionary()  # this process's, by id


def _layout(d: Any, want: str) -> RankLayout:
    """The layout the registry sent for ``want``: its bytes must give that id (content-addressed); a layout
    another client of this process checked under that id is that very layout, and is shared."""
    encoded = orjson.dumps(d)
    found = hashlib.blake2b(encoded, digest_size=16).hexdigest()
    if found != want:
        raise ManifestError(f"the registry sent layout {found[:12]} for {want[:12]}")
    held = _CHECKED.get(want)
    if held is None:
        held = _CHECKED[want] = RankLayout(layout_from_dict(d), encoded)
    return held


class _Part:
    """One plan's part, as sent: the layouts it was planned on, its runs, its id once the registry gave it."""

    def __init__(self, order: Sequence[Any], used: np.ndarray | None, layouts: list[list[Any]], runs: bytes,
                 where: np.ndarray | None) -> None:  # fmt: skip
        self.order, self.used, self.layouts, self.runs, self.where = order, used, layouts, runs, where
        self.id: str | None = None


def _part(order: Sequence[tuple[int, int, Any]], count: int, used: np.ndarray | None,
          layouts: Sequence[RankLayout]) -> _Part:  # fmt: skip
    """The part a plan reads: its order checked against ``layouts`` (each shard where, and what, the plan read
    it as), as runs ``(rank, first, count)`` in vector order (``used``: only those indices)."""
    try:
        places = [_PLACE(layouts[s].manifest.shards[p]) for s, p, _ in order]
    except IndexError:
        places = []
    if places != [place for _, _, place in order]:
        raise ManifestError("the publication's shards are not where, or not what, its layout digest says")
    src = np.fromiter((s for s, _, _ in order), dtype=np.int64, count=len(order))
    pos = np.fromiter((p for _, p, _ in order), dtype=np.int64, count=len(order))
    first = np.array([layouts[s].offsets[p] for s, p, _ in order], dtype=np.int64)
    size = np.array([layouts[s].offsets[p + 1] - layouts[s].offsets[p] for s, p, _ in order], dtype=np.int64)
    if int(size.sum()) != count:
        raise ManifestError("the publication's digests do not fit its layout digest")
    del pos
    if used is None:  # every digest of every shard read, in the plan's order
        rank, index = np.repeat(src, size), np.repeat(first, size) + _within(size)
    else:
        base = np.cumsum(size) - size
        k = np.searchsorted(base, used, side="right") - 1
        rank, index = src[k], first[k] + (used - base[k])
    cut = np.flatnonzero((np.diff(rank) != 0) | (np.diff(index) != 1)) + 1  # runs of consecutive digests
    starts = np.concatenate([[0], cut]).astype(np.int64)
    counts = np.diff(np.concatenate([starts, [len(rank)]]))
    runs = np.stack([rank[starts], index[starts], counts], axis=1).astype("<i8") if len(rank) else np.zeros(
        (0, 3), dtype="<i8")  # fmt: skip
    ranks = sorted({int(r) for r in np.unique(rank)})
    return _Part(order, used, [[r, layouts[r].id] for r in ranks], runs.tobytes(), used)


def _within(size: np.ndarray) -> np.ndarray:
    """0, 1, …, size[i] - 1 for each i, concatenated."""
    ends = np.cumsum(size)
    return np.arange(int(ends[-1]) if len(ends) else 0) - np.repeat(ends - size, size)


class Fetched:
    def __init__(self, request: Callable[..., Awaitable[Any]], size: int) -> None:
        self._request = request
        self._size = size
        self._cache: OrderedDict[tuple[Any, ...], Publication] = OrderedDict()
        self._fetching: dict[tuple[Any, ...], asyncio.Future[Publication]] = {}
        self._layouts: OrderedDict[str, RankLayout] = OrderedDict()
        self._parts: OrderedDict[tuple[int, int, tuple[str, ...]], _Part] = OrderedDict()
        self.fetches = 0  # whole-publication fetches (for tests and benches: one per new version)
        self.part_bytes = 0  # digest bytes fetched as parts (for benches)

    def forget_parts(self) -> None:
        """The registry may not hold the parts sent (it restarted, or another replica answers)."""
        for part in self._parts.values():
            part.id = None

    async def layouts(self, ids: Sequence[str]) -> list[RankLayout]:
        """The rank layouts of ``ids`` (fetched once each, checked)."""
        missing = list(dict.fromkeys(i for i in ids if i not in self._layouts))
        if missing:
            docs = await self._request("layouts", ids=missing)
            if not isinstance(docs, list) or len(docs) != len(missing):
                raise ManifestError("the registry answered layouts for other ids")
            big = sum(len(d.get("shards", {}).get("each", {}).get("name", ())) for d in docs) > 1000
            make = partial(lambda ds: [_layout(d, i) for d, i in zip(ds, missing, strict=True)], docs)
            for layout in await asyncio.to_thread(make) if big else make():
                self._layouts[layout.id] = layout
        out = []
        for i in ids:
            self._layouts.move_to_end(i)
            out.append(self._layouts[i])
        while len(self._layouts) > LAYOUTS:
            self._layouts.popitem(last=False)
        return out

    async def outline(self, found: dict[str, Any]) -> Outline:
        """The version ``latest`` found, as a receiver plans and reads it (see the module docstring)."""
        layouts = await self.layouts(found["layouts"])
        revisions = tuple(found["revisions"])
        if len(layouts) != len(revisions):
            raise ManifestError("the registry answered revisions and layouts of other ranks")
        manifests = tuple(restamp(la.manifest, found["version"], r) for la, r in zip(layouts, revisions, strict=True))
        identity = identity_from_dict(found["identity"])
        fetch = partial(self._vector, identity, found["version"], not all(revisions), layouts)
        return Outline(identity=identity, version=found["version"], manifests=manifests, revisions=revisions,
                       fetch=fetch)  # fmt: skip

    async def _vector(
        self, identity: Identity, version: int, early: bool, layouts: list[RankLayout],
        order: Sequence[tuple[int, int, Any]], count: int, used: np.ndarray | None,
    ) -> np.ndarray:  # fmt: skip
        key = (id(order), id(used), tuple(la.id for la in layouts))
        part = self._parts.get(key)
        if part is None or part.order is not order or part.used is not used:
            big = len(order) > 1000 or (used is not None and len(used) > 1 << 16)
            make = partial(_part, order, count, used, layouts)
            part = self._parts[key] = await asyncio.to_thread(make) if big else make()
            while len(self._parts) > _PARTS:
                self._parts.popitem(last=False)
        ask = {"identity": identity_to_dict(identity), "version": version, "early": early}
        found = None
        if part.id is not None:
            try:
                found = await self._request("part", part=part.id, **ask)
            except ManifestError as exc:
                if UNKNOWN_LAYOUT not in exc.reason:
                    raise
        if found is None:
            found = await self._request("part", layouts=part.layouts, runs=Blob(part.runs), **ask)
            part.id = str(found["part"])
        data = found["digests"]
        self.part_bytes += len(data)
        got = np.frombuffer(data, dtype=">u8")
        if part.where is None:
            if len(got) != count:
                raise ManifestError(f"the registry sent {len(got)} digests for a part of {count}", version=version)
            return got.astype(np.uint64)
        if len(got) != len(part.where):
            raise ManifestError(f"the registry sent {len(got)} digests for a part of {len(part.where)}",
                                version=version)  # fmt: skip
        vector = np.zeros(count, dtype=np.uint64)
        vector[part.where] = got
        return vector

    async def get(self, found: dict[str, Any]) -> Publication:
        """The publication ``latest`` found, whole (``{"identity", "version", "revisions", "layouts"}``)."""
        key = (tuple(sorted(found["identity"].items())), found["version"], tuple(found["revisions"]))
        pub = self._cache.get(key)
        if pub is None:
            fetching = self._fetching.get(key)
            if fetching is None:  # one fetch per version, however many ask at once
                fetching = self._fetching[key] = asyncio.ensure_future(self._fetch(found))
                fetching.add_done_callback(lambda _: self._fetching.pop(key, None))
            pub = await asyncio.shield(fetching)
            if pub.pending:  # not kept: revisions "" do not tell a re-announcement (a new address) apart
                return pub
            self._cache[key] = pub
            while len(self._cache) > self._size:
                self._cache.popitem(last=False)
        self._cache.move_to_end(key)
        return pub

    def cancel(self) -> None:
        """Cancel the fetches under way (the client closes)."""
        for fetching in self._fetching.values():
            fetching.cancel()

    async def _fetch(self, found: dict[str, Any]) -> Publication:
        version = found["version"]
        got = await self._request("publication", identity=found["identity"], version=version,
                                  early=not all(found["revisions"]))  # fmt: skip
        self.fetches += 1
        if not isinstance(got, dict) or not all(isinstance(got.get(k), list) for k in ("revisions", "layouts")):
            raise ManifestError("the registry answered a publication of another form")
        layouts = await self.layouts(got["layouts"])
        identity = identity_from_dict(found["identity"])
        rows = zip(layouts, got["revisions"], got["digests"], strict=True)
        records = [RankRecord(identity=identity, version=version, rank=la.rank, layout=la.id, revision=str(r),
                              digests=d) for la, r, d in rows]  # fmt: skip
        if not records:
            raise VersionError("the registry returned no manifests", version=version)
        # each record checked against its layout (its size, its revision) and made whole: off the event loop
        many = sum(len(la.manifest.shards) for la in layouts) > 1000
        make = partial(lambda: tuple(materialise(la, rec, check_record(la, rec))
                                     for la, rec in zip(layouts, records, strict=True)))  # fmt: skip
        manifests: tuple[Manifest, ...] = await asyncio.to_thread(make) if many else make()
        return Publication(identity=manifests[0].identity, version=version, manifests=manifests)
