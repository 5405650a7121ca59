"""What a stage sees of the rest of the system, as small Protocols (stages never import pipeline/)."""

from __future__ import annotations

from collections.abc import Collection, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from refitflow.core.types import Identity, Publication
from refitflow.layouts.canonical import LocalTensor
from refitflow.metrics import NULL_OBSERVER, Observer
from refitflow.transports.base import Transport

__all__ = ["Attempt", "Discovery", "Landing", "Lease", "Limits", "StageContext", "Staging", "Work"]


@dataclass(frozen=True, slots=True)
class Lease:
    """Staging bytes held against the budget."""

    offset: int
    nbytes: int
    view: torch.Tensor  # uint8


class Staging(Protocol):
    async def allocate(self, nbytes: int) -> Lease: ...
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
    def derived(self) -> Mapping[str, str]: ...

    @property
    def generation(self) -> int: ...
    def target(self, name: str) -> torch.Tensor: ...
    def assembly(self, name: str) -> torch.Tensor: ...
    def release_assembly(self, name: str) -> torch.Tensor: ...


class Attempt(Protocol):
    """The open transaction, as the stages may touch it."""

    version: int

    def mark_written(self) -> None: ...
    def record(self, param: str, region: Hashable, numel: int) -> None: ...
    def prepare(self) -> None: ...


class Discovery(Protocol):
    async def wait_complete(
        self, identity: Identity, min_version: int, timeout: float, *, compile_targets: Collection[str] | None = None
    ) -> Publication: ...


@dataclass(frozen=True, kw_only=True)
class Limits:
    bucket_bytes: int
    direct_bucket_bytes: int
    max_reads_per_bucket: int
    lossy_casts: bool
    read_timeout_s: float
    verify: str = "strict"  # strict: widen partial pulls to whole digest blocks; pulled: verify what is whole
    max_strided_runs: int = 1024  # contiguous runs per piece of a strided (column) read
    min_run_bytes: int = 32  # strided runs shorter than this read the enclosing rows instead
    compile_targets: tuple[str, ...] | None = None  # None: any
    compile_metadata: tuple[tuple[str, str], ...] = ()  # required subset


@dataclass(kw_only=True)
class StageContext:
    transport: Transport
    staging: Staging
    landing: Landing
    limits: Limits
    observer: Observer = NULL_OBSERVER
    publication: Publication | None = None
    attempt: Attempt | None = None
    plan: Any = None  # the Plan in use (stages.plan.Plan)
    discovered_at: float = 0.0  # perf_counter when the publication was found
    waited_s: float = 0.0  # how long discovery waited for it
    reroute: Any = None  # stages._reroute.Rerouter: replica sources that failed during this attempt
    stats: dict[str, list[float]] = field(default_factory=dict)  # stage -> [items, bytes, busy seconds]
    unverified_bytes: int = 0  # pulled bytes no whole digest block covered

    def connect_sources(self, pub: Publication) -> None:
        for m in pub.sources:
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
