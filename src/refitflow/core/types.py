"""The data that crosses process boundaries: identity, shard specs, manifests, publications.

All of it is frozen and validated on construction, so a malformed manifest is refused where it
enters (``ManifestError`` naming the problem) and never reaches the planner.
"""

from __future__ import annotations

import binascii
import math
import operator
import re
import string
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from typing import Any

import numpy as np
import orjson
import xxhash

from refitflow.core.digests import ALGORITHMS, Tiling
from refitflow.core.dtypes import itemsize
from refitflow.core.errors import ManifestError, PlanError

__all__ = [
    "Identity", "Manifest", "Publication", "ShardSpec", "SourceAddress", "digests_of", "revision_of", "shard_tiling"
]

_HEX = frozenset(string.hexdigits)

# What a manifest may hold at all, whoever sends it: beyond these it is a mistake or an attack, never a
# model. A tensor name is 1-1024 characters: letters, digits and ``_ . - :``, not starting with ``.``,
# ``-`` or ``:`` (so no NUL, no path separator, no ``..``).
TENSOR_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:-]{0,1023}")
MAX_DIMS = 8
MAX_ELEMENTS = 1 << 48  # per tensor (2.8e14; a 1e18-element tensor is refused)
MAX_WORLD_SIZE = 1 << 20
MAX_INT = (1 << 63) - 1  # versions, regions and offsets fit a signed 64-bit integer


def _check_shard_limits(s: ShardSpec) -> None:
    if not TENSOR_NAME.fullmatch(s.name):
        raise ManifestError(
            f"tensor name {s.name!r:.80} not allowed: 1-1024 letters, digits and '_.-:', starting with a letter, "
            "digit or '_'"
        )
    if not isinstance(s.global_shape, tuple) or len(s.global_shape) > MAX_DIMS:
        raise ManifestError(f"a shape has at most {MAX_DIMS} dimensions, got {s.global_shape!r:.80}", tensor=s.name)
    if not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= MAX_ELEMENTS for d in s.global_shape) or (
        math.prod(s.global_shape) > MAX_ELEMENTS
    ):
        raise ManifestError(f"bad global shape {s.global_shape!r:.80} (at most {MAX_ELEMENTS} elements)",
                            tensor=s.name)  # fmt: skip
    for field_name in ("start", "stop", "region", "offset", "tile_rows", "tile_cols"):
        value = getattr(s, field_name)
        if not isinstance(value, int) or isinstance(value, bool) or value > MAX_INT:
            raise ManifestError(f"{field_name} must be an integer below 2**63, got {value!r:.40}", tensor=s.name)


@dataclass(frozen=True, kw_only=True)
class Identity:
    """What makes two publications interchangeable."""

    model: str
    layout: str = "hf"
    dtype: str = "any"
    parallelism: str = "any"
    compile_target: str = "hf_raw"

    def __post_init__(self) -> None:
        for name in ("model", "layout", "dtype", "parallelism", "compile_target"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ManifestError(f"identity.{name} must be a non-empty string, got {value!r}")

    def key(self) -> str:
        return f"{self.model}|{self.layout}|{self.dtype}|{self.parallelism}|{self.compile_target}"


@dataclass(frozen=True, kw_only=True)
class SourceAddress:
    """How to reach one source's memory: transport name, agent name and opaque transport metadata."""

    transport: str
    agent: str
    metadata: bytes = b""


@dataclass(frozen=True, kw_only=True)
class ShardSpec:
    """The part of one tensor a source holds, and where its bytes live in the source's memory.

    ``axis is None`` means the source holds the whole tensor (replicated or unsharded).

    Integrity (``core/digests.py``, ``core/hashing.py``): ``algo`` (``xxh3`` or ``mix64``) over tiles of
    ``tile_rows`` rows × ``tile_cols`` columns; ``blocks`` is the base64 of the digests (8 bytes each, big-endian, in
    ``Tiling`` order) and ``digest`` the xxh3_64 of those bytes. ``tile_rows == 0``: no ``blocks``, and
    ``digest`` is the one digest of the whole shard.
    ``compile_target``/``compile_metadata``: what the bytes were compiled for (receivers may filter).
    """

    name: str
    dtype: str
    global_shape: tuple[int, ...]
    axis: int | None
    start: int
    stop: int
    digest: str
    region: int
    offset: int = 0
    algo: str = "xxh3"
    tile_rows: int = 0
    tile_cols: int = 0
    blocks: str = ""
    compile_target: str = ""
    compile_metadata: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ManifestError(f"shard name must be a non-empty string, got {self.name!r:.80}")
        _check_shard_limits(self)
        try:
            itemsize(self.dtype)
        except PlanError as exc:
            raise ManifestError(exc.reason, tensor=self.name) from None
        if self.axis is None:
            if (self.start, self.stop) != (0, self.global_shape[0] if self.global_shape else 1):
                raise ManifestError("an unsharded spec must cover [0, dim0)", tensor=self.name)
        else:
            if not 0 <= self.axis < len(self.global_shape):
                raise ManifestError(f"shard axis {self.axis} outside shape {self.global_shape}", tensor=self.name)
            if not 0 <= self.start < self.stop <= self.global_shape[self.axis]:
                raise ManifestError(
                    f"shard range [{self.start}, {self.stop}) outside axis {self.axis} of {self.global_shape}",
                    tensor=self.name,
                )
        if not isinstance(self.digest, str) or len(self.digest) not in (0, 16) or not _HEX.issuperset(self.digest):
            raise ManifestError("digest not a 16-hex-digit xxh3_64 (or empty: pending)", tensor=self.name)
        if self.region < 0 or self.offset < 0:
            raise ManifestError("negative region or offset", tensor=self.name)
        self._check_digests()

    def _check_digests(self) -> None:
        """The digest geometry fits the shard and ``blocks`` holds one digest per unit."""
        if self.algo not in ALGORITHMS:
            raise ManifestError(f"unknown digest algorithm {self.algo!r}; known: {list(ALGORITHMS)}", tensor=self.name)
        try:
            tiling = self.tiling
        except ValueError as exc:
            raise ManifestError(str(exc), tensor=self.name) from None
        if self.pending:  # the geometry alone: the values follow (``Manifest.pending``)
            if self.blocks:
                raise ManifestError("a pending digest has no blocks", tensor=self.name)
            return
        if bool(self.tile_rows) != bool(self.blocks):
            raise ManifestError("tile_rows and blocks go together", tensor=self.name)
        if len(self.digest_bytes) != 8 * tiling.count:
            raise ManifestError(f"{len(self.digest_bytes) // 8} block digests for {tiling.count} blocks",
                                tensor=self.name)  # fmt: skip

    @property
    def pending(self) -> bool:
        """Announced before its digests: the geometry is here, the values come with the complete manifest."""
        return not self.digest

    @property
    def tiling(self) -> Tiling:
        """The digest geometry (``core.digests.Tiling``)."""
        return shard_tiling(self.algo, self.shape, itemsize(self.dtype), self.tile_rows, self.tile_cols)

    @property
    def digest_bytes(self) -> bytes:
        """Every digest, 8 bytes each, big-endian (decoded on each call: verify asks once per refit)."""
        if self.pending:
            raise ManifestError("its digests are pending (announced before them)", tensor=self.name)
        try:
            return _digest_bytes(self.blocks, self.digest)
        except (binascii.Error, ValueError):
            what = "blocks is not base64" if self.blocks else "digest is not hexadecimal"
            raise ManifestError(what, tensor=self.name) from None

    def digest_array(self) -> np.ndarray:
        """The digests as native uint64."""
        return np.frombuffer(self.digest_bytes, dtype=">u8").astype(np.uint64)

    @property
    def rows(self) -> int:
        return self.shape[0] if self.shape else 1

    @property
    def row_bytes(self) -> int:
        return math.prod(self.shape[1:]) * itemsize(self.dtype)

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the bytes this source holds (contiguous, row-major)."""
        if self.axis is None:
            return self.global_shape
        shape = list(self.global_shape)
        shape[self.axis] = self.stop - self.start
        return tuple(shape)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(self.dtype)

    def layout_key(self) -> tuple[Any, ...]:
        """Everything that shapes a plan, nothing that changes with the bytes."""
        return _LAYOUT(self)


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """What one source announces for one version."""

    identity: Identity
    version: int
    rank: int
    world_size: int
    source: SourceAddress
    shards: tuple[ShardSpec, ...]
    revision: str = ""
    metadata: dict[str, str] = field(default_factory=dict)
    # Two-phase publication: a manifest may be announced *pending* — every shard's digest geometry (algorithm,
    # tiles) but no digest values, revision "" — and then again complete, with the same layout; receivers pull
    # as soon as every rank announced it and compare once the values are in (docs/architecture.md).
    # a digest of everything that shapes a plan (names, shapes, dtypes, ranges, regions, layout), computed
    # by the publisher; receivers key their cached plans on it. A wrong one cannot corrupt a refit: every
    # pulled byte is still checked against this version's content digests.
    layout_digest: str = ""

    def __post_init__(self) -> None:
        _check_manifest_limits(self)
        if not 0 <= self.rank < self.world_size:
            raise ManifestError(f"rank {self.rank} outside world size {self.world_size}", version=self.version)
        names = list(map(_NAME, self.shards))
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise ManifestError(f"tensor names repeated in one manifest: {dup[:20]}", version=self.version)
        digests = set(map(_DIGEST, self.shards))
        if "" in digests and len(digests) > 1:
            raise ManifestError("a manifest's digests are all pending or none", version=self.version)
        expected = "" if "" in digests else revision_of(self.shards)
        if not self.revision:
            object.__setattr__(self, "revision", expected)
        elif self.revision != expected:
            raise ManifestError("revision does not match the shard digests", version=self.version)
        if not self.layout_digest:  # orjson: 10,000 shards in ≈ 1 ms (a repr each: ≈ 10 ms)
            h = xxhash.xxh3_128(repr(self.metadata.get("layout")).encode())
            for key in ("quant", "digests"):  # quantised pairs and row-only digests shape plans too
                if key in self.metadata:
                    h.update(f"{key}={self.metadata[key]}".encode())
            h.update(orjson.dumps(list(map(_LAYOUT, self.shards))))
            object.__setattr__(self, "layout_digest", h.hexdigest())
        if expected:  # its digests are in (see ``digest_blob``)
            self.digest_blob  # noqa: B018

    @property
    def pending(self) -> bool:
        """Announced before its digests (see above)."""
        return self.shards[0].pending

    @cached_property
    def digest_blob(self) -> bytes:
        """Every shard's digests, 8 bytes each, big-endian, shard after shard (``digests_of``; ``ManifestError``
        while pending) — the rank's digest vector, as a record carries it. Decoded as the manifest is made, while
        its shards are fresh in the cache (10,000 shards: ≈ 0.6 ms): a receiver's plan gathers its vector from it
        (``planner.vector``; decoded shard by shard at the refit, ≈ 2 ms before its first read)."""
        return digests_of(self.shards)

    @cached_property
    def positions(self) -> dict[str, int]:
        """Each shard's position by name, built once (a plan looks shards up by name: read it, never change it)."""
        return dict(zip(map(_NAME, self.shards), range(len(self.shards)), strict=True))

    def completes(self, pending: Manifest) -> bool:
        """Whether this manifest is ``pending`` with its digests: the same rank, version, source and layout."""
        head = lambda m: (m.identity, m.version, m.rank, m.world_size, m.source, m.metadata)  # noqa: E731
        return (
            pending.pending and not self.pending and head(self) == head(pending)
            and list(map(_LAYOUT, self.shards)) == list(map(_LAYOUT, pending.shards))
        )  # fmt: skip


def _check_manifest_limits(m: Manifest) -> None:
    if not isinstance(m.version, int) or isinstance(m.version, bool) or not 0 <= m.version <= MAX_INT:
        raise ManifestError(f"version must be an integer in [0, 2**63), got {m.version!r:.40}")
    if not isinstance(m.world_size, int) or not 1 <= m.world_size <= MAX_WORLD_SIZE:
        raise ManifestError(f"world size must be in [1, {MAX_WORLD_SIZE}], got {m.world_size!r:.40}",
                            version=m.version)  # fmt: skip
    if not m.shards:
        raise ManifestError("a manifest announces at least one shard", version=m.version)


# Derived from a spec's fields, cached by value outside the (frozen) specs, so ``vars(spec)`` holds
# only fields: a plan asks for it per tensor, and shapes repeat layer after layer.
@lru_cache(maxsize=1 << 14)
def shard_tiling(algo: str, shape: tuple[int, ...], item: int, tile_rows: int, tile_cols: int) -> Tiling:
    return Tiling(algo, shape, item, tile_rows, tile_cols)


_a2b = binascii.a2b_base64


def _digest_bytes(blocks: str, digest: str) -> bytes:
    return _a2b(blocks, strict_mode=True) if blocks else bytes.fromhex(digest)


def digests_of(shards: Sequence[ShardSpec]) -> bytes:
    """Every digest of ``shards`` in order, 8 bytes each, big-endian: ``b"".join(s.digest_bytes for s in
    shards)`` in one loop of plain attribute reads (10,000 shards: ≈ 0.6 ms; through attrgetters ≈ 1 ms,
    ``digest_bytes`` each 2.3); ``ManifestError`` for a pending one."""
    try:
        return b"".join([_a2b(s.blocks, strict_mode=True) if s.blocks else bytes.fromhex(s.digest or "-")
                         for s in shards])  # fmt: skip
    except (binascii.Error, ValueError):
        pass
    for s in shards:  # the shard at fault, with its own error
        s.digest_bytes  # noqa: B018
    raise AssertionError("unreachable: every shard decoded on its own")


def revision_of(shards: tuple[ShardSpec, ...] | list[ShardSpec]) -> str:
    """A content revision: the digest of every shard's identity and digest, in manifest order (the order is
    content: it orders the version's digest vector). ≈ 0.3 µs a shard."""
    return xxhash.xxh3_128_hexdigest(orjson.dumps(list(map(_REVISION, shards))))


_LAYOUT = operator.attrgetter(
    "name", "dtype", "global_shape", "axis", "start", "stop", "region", "offset", "algo", "tile_rows", "tile_cols"
)  # ShardSpec.layout_key
_NAME, _DIGEST = operator.attrgetter("name"), operator.attrgetter("digest")
_REVISION = operator.attrgetter("name", "dtype", "global_shape", "axis", "start", "stop", "digest")
TILING_FIELDS = ("algo", "global_shape", "axis", "start", "stop", "dtype", "tile_rows", "tile_cols")
TILING_KEY = operator.attrgetter(*TILING_FIELDS)
"""What fixes a shard's ``tiling``: shards equal in it share one (a plan looks them up by it)."""


@dataclass(frozen=True, kw_only=True)
class Publication:
    """One complete version: a manifest from every rank of the publisher's world, in rank order
    (a plan's source index is a rank)."""

    identity: Identity
    version: int
    manifests: tuple[Manifest, ...]

    @property
    def revision(self) -> str:
        h = xxhash.xxh3_128()
        for m in self.manifests:
            h.update(m.revision.encode())
        return h.hexdigest()

    def layout_key(self) -> tuple[Any, ...]:
        return tuple((m.rank, m.source.agent, m.layout_digest) for m in self.manifests)

    @property
    def pending(self) -> bool:
        """Some rank announced it before its digests: the plan and the reads may start, not the checks."""
        return any(m.pending for m in self.manifests)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for m in self.manifests for s in m.shards)
