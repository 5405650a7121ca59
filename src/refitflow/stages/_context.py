"""What a stage sees of the rest of the system, as small Protocols (stages never import pipeline/)."""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from refitflow.core.types import Identity, Publication
from refitflow.layouts.canonical import LocalTensor
from refitflow.layouts.quant import QuantParam
from refitflow.metrics import NULL_OBSERVER, Observer
from refitflow.transports.base import Transport

__all__ = [
    "Attempt", "Counts", "Devices", "Discovery", "Fanout", "Landing", "Lease", "Limits", "StageContext", "Staging",
    "Work",
]  # fmt: skip


@dataclass(frozen=True, slots=True)
class Lease:
    """Staging bytes held against the budget."""

    offset: int
    nbytes: int
    view: torch.Tensor  # uint8


class Staging(Protocol):
    async def allocate(self, nbytes: int, device: str) -> Lease: ...
    def free(self, lease: Lease) -> None: ...
    def free_all(self) -> None: ...


class Landing(Protocol):
    """The destination parameters: their names, shapes, dtypes and the tensors to write."""

    @property
    def params(self) -> Mapping[str, torch.Tensor]: ...
    @property
    def canonical(self) -> Mapping[str, str]: ...
    @property
    def layout(self) -> Mapping[str, LocalTensor] | None: ...
    @property
    def layout_key(self) -> Hashable: ...

    @property
    def quantised(self) -> Mapping[str, QuantParam]: ...  # values name -> format and partners (layouts/quant)
    @property
    def scales(self) -> frozenset[str]: ...  # the quantised parameters' scales and global scales
    @property
    def expected(self) -> Mapping[str, int]: ...  # elements each parameter receives (its layout's, else all)

    @property
    def generation(self) -> int: ...
    def target(self, name: str) -> torch.Tensor: ...
    def target_bytes(self, name: str) -> torch.Tensor: ...  # target(name) as a flat uint8 view
    def target_memory(self, name: str) -> memoryview | None: ...  # ... as a memoryview (None: on a device)
    def live(self, name: str) -> torch.Tensor: ...
    def holding(self, which: str) -> tuple[Hashable, Any] | None: ...  # "target" | "live": (geometry, digests)
    def assembly(self, name: str, like: torch.Tensor | None = None) -> torch.Tensor: ...
    def release_assembly(self, name: str) -> torch.Tensor: ...


class Devices(Protocol):
    """Where device work runs (``pipeline.device.DeviceLane``): refit streams and marks to wait for."""

    def use(self, devices: Iterable[torch.device | str]) -> contextlib.AbstractContextManager[None]: ...
    def record(self, devices: Iterable[torch.device | str]) -> tuple[Any, ...]: ...
    async def wait(self, marks: tuple[Any, ...]) -> None: ...
    async def drain(self) -> None: ...
    async def quiesce(self) -> None: ...


class Attempt(Protocol):
    """The open transaction, as the stages may touch it."""

    version: int

    def mark_written(self) -> None: ...
    def record(self, param: str, region: Hashable, numel: int) -> None: ...
    def credit(self, key: Hashable, params: tuple[str, ...], idx: Any, counts: Any) -> None: ...
    def hold(self, geometry: Hashable, digests: Any) -> None: ...  # the version's digests (delta refits)
    def complete(self, revision: str) -> None: ...  # announced before its digests: now they are in
    def prepare(self) -> None: ...


class Fanout(Protocol):
    """Pipelined fan-out as the stages see it (``pipeline.relay.Relaying``)."""

    serve: bool  # this rank offers itself as a relay

    def begin(self, version: int) -> None:
        """``version`` is about to land (before any byte does): a relay's status says so."""

    async def join(self, ctx: StageContext) -> None:
        """With a plan: offer this rank as a relay (if it serves) and bind an upstream (``ctx.upstream``)."""

    def verified(self, credits: Any) -> None:
        """A verified bucket's elements per parameter (``Credits``): relay progress."""


class Discovery(Protocol):
    async def wait_complete(
        self, identity: Identity, min_version: int, timeout: float, *, compile_targets: Collection[str] | None = None,
        early: bool = False, skip: Collection[int] = (),
    ) -> Publication: ...  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class Limits:
    bucket_bytes: int
    direct_bucket_bytes: int
    max_reads_per_bucket: int
    lossy_casts: bool
    read_timeout_s: float
    relay_wait_s: float = 5.0  # how long a reader waits for an upstream relay that makes no progress
    skip_unchanged: bool = True  # delta refits: leave pieces whose digests did not change (stages/_delta.py)
    recheck_fraction: float = 0.125  # of skipped pieces, re-hashed each refit (rotating)
    read_early: bool = True  # read a version announced before its digests; compare when they arrive
    verify: str = "strict"  # strict: widen partial pulls to whole digest blocks; pulled: verify what is whole
    max_strided_runs: int = 1024  # contiguous runs per piece of a strided (column) read
    min_run_bytes: int = 32  # strided runs shorter than this read the enclosing rows instead
    compile_targets: tuple[str, ...] | None = None  # None: any
    compile_metadata: tuple[tuple[str, str], ...] = ()  # required subset
    max_direct_buckets: int = 2048  # more direct bytes than this many batches hold: larger batches
    read_start: float = 0.0  # where in its slice (a fraction of its bytes) the plan starts, wrapping round


@dataclass
class Counts:
    """Bytes of one refit by how they arrived (``RefitResult``)."""

    pulled: int = 0  # read from a source (trainer or relay), re-reads included
    skipped: int = 0  # not read: unchanged since the version a storage holds (delta refits)
    relayed: int = 0  # of ``pulled``, read from an upstream relay
    rerouted: int = 0  # of ``pulled``, read from the trainer after a relay failed, stalled or sent bad bytes
    rechecked: int = 0  # of ``skipped``, re-hashed where they lie
    repaired: int = 0  # of ``rechecked``, differed from the digests and were read again


@dataclass(kw_only=True)
class StageContext:
    transport: Transport | None  # None: bytes arrive another way (a push stream), not by reads
    staging: Staging
    landing: Landing
    limits: Limits
    devices: Devices
    observer: Observer = NULL_OBSERVER
    publication: Publication | None = None
    attempt: Attempt | None = None
    plan: Any = None  # the Plan in use (stages.plan.Plan)
    discovered_at: float = 0.0  # perf_counter when the publication was found
    waited_s: float = 0.0  # how long discovery waited for it
    fanout: Fanout | None = None  # pipelined fan-out (None: this rank neither relays nor reads relays)
    upstream: Any = None  # stages._relay.Upstream: the relay this attempt reads from, if any
    digests: Any = None  # the version's digest vector (stages._checks.digest_vector), decoded once per refit
    complete: Any = None  # a pending publication: an async callable → the same version with its digests
    skips: Any = None  # stages._delta.Skips: this refit's delta decision, if any piece is skipped
    verified_through: int = -1  # every unit of buckets up to this index is verified (relay progress)
    counts: Counts = field(default_factory=Counts)
    stats: dict[str, list[float]] = field(default_factory=dict)  # stage -> [items, bytes, busy seconds]
    unverified_bytes: int = 0  # pulled bytes no whole digest block covered
    unreadable: set[int] = field(default_factory=set)  # versions whose sources this receiver cannot reach (kept)

    def connect_sources(self, pub: Publication) -> None:
        assert self.transport is not None
        for m in pub.manifests:
            self.transport.connect(m.source)

    def enter(self, stage: str) -> None:
        self.observer.stage_enter(stage)

    def note(self, stage: str, items: int, nbytes: int, seconds: float, *, item: bool = True) -> None:
        """Account work a stage did (for the result's table; ``item``: one item left, tell the observer)."""
        row = self.stats.setdefault(stage, [0, 0, 0.0])
        row[0] += items
        row[1] += nbytes
        row[2] += seconds
        if item:
            self.observer.stage_item(stage, nbytes, seconds)


@dataclass(eq=False, slots=True)
class Work:
    """One bucket on its way through allocate → pull → translate → apply → verify → commit."""

    bucket: Any  # stages.plan.Bucket
    lease: Lease | None = None
    copies: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (dst, src) views
    marks: tuple[Any, ...] = ()  # the bucket's device work so far (Devices.record); empty on CPU
    actions: Any = None  # delta refits: per piece PULL, HELD or COPY (stages._delta); None: pull every piece
    recheck: Any = None  # per piece: a skipped piece re-hashed where it lies
    relayed: list[int] = field(default_factory=list)  # pieces read from the upstream relay
