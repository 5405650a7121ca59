"""The records a plan is made of: pieces of trainer shards, the reads that pull them, buckets, the plan.

The per-tensor records (``Piece``, ``Scatter``, ``PlannedRead``; likewise ``copies.Copy`` and ``Held``,
``checks.Land``) are slots dataclasses that are not frozen: a first plan of 10,000 tensors makes about
60,000 of them, and a frozen one costs 2–3× as much to construct (≈ 45 ms of that plan). Nothing writes
to a built plan.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from refitflow.core.errors import PlanError
from refitflow.core.types import Publication
from refitflow.layouts.boxes import Box, shape_of
from refitflow.planner.checks import Checks, Credits
from refitflow.planner.copies import Copy
from refitflow.planner.receiver_layout import ReceiverLayout
from refitflow.planner.routes import Route
from refitflow.planner.vector import DigestRuns, digest_vector

__all__ = ["Bucket", "Piece", "Plan", "PlannedRead", "Scatter"]

_SERIALS = itertools.count()


@dataclass(slots=True, unsafe_hash=True)  # a plan record: see above
class Scatter:
    """``piece[sub]`` (source coordinates, inside the piece's box) → ``param[dbox]``."""

    param: str
    sub: Box
    dbox: Box


@dataclass(slots=True, unsafe_hash=True)  # a plan record: see above
class Piece:
    """A box of one source shard, read as ``count`` runs of ``run`` elements, ``stride`` apart."""

    source: int  # index of the manifest in the publication
    tensor: str  # the source shard's name
    src_dtype: str
    box: Box  # in the shard's local coordinates
    first: int  # the shard element the first run starts at
    run: int  # elements per run
    stride: int  # elements from one run's start to the next (0: one run)
    count: int  # runs
    src_region: int
    src_offset: int  # the shard's byte offset in its region
    nbytes: int
    direct: bool  # lands straight in the destination: no staging, no copy
    landing_offset: int  # direct: byte offset in the parameter; staged: byte offset in the bucket
    scatters: tuple[Scatter, ...]
    device: str  # where it lands: its parameter's device (direct), the staging ring's (staged)

    @property
    def shape(self) -> tuple[int, ...]:
        return shape_of(self.box)


@dataclass(slots=True, unsafe_hash=True)  # a plan record: see above
class PlannedRead:
    """One read: ``count`` runs of ``nbytes`` source bytes, ``stride`` apart, landing back to back in a
    parameter (direct) or the bucket's staging."""

    source: int
    region: int
    src_offset: int
    nbytes: int  # per run
    param: str | None  # None: into staging
    landing_offset: int
    stride: int = 0  # source bytes from one run's start to the next
    count: int = 1


@dataclass(frozen=True, slots=True)
class Bucket:
    index: int
    pieces: tuple[Piece, ...]
    reads: tuple[PlannedRead, ...]
    staging_bytes: int  # the staging lease (staged pieces at 8-byte aligned offsets)
    direct_bytes: int
    device: str  # the device of its staging (all its staged pieces land on one device)
    devices: tuple[str, ...]  # every device its work touches: staging and destinations
    staged: tuple[Piece, ...] = ()  # the pieces translate and apply handle
    derived: tuple[Scatter, ...] = ()  # scatters into assemblies (quantised or converted at commit: planner/routes)
    pulled_bytes: int = 0
    # what verify and commit need (``planner.checks``), built once, on first use: the plan stage builds them
    # in a worker thread as it hands the buckets on (``built``), so a first refit reads while they are made
    make: Callable[[], tuple[Checks, Credits]] | None = field(default=None, compare=False, repr=False)
    made: list[tuple[Checks | None, Credits | None]] = field(default_factory=list, compare=False, repr=False)

    @property
    def nbytes(self) -> int:
        """Source bytes pulled."""
        return self.pulled_bytes

    @property
    def planned(self) -> bool:
        """Made by a plan, with checks and credits (a push stream's buckets are made without: credited box by box)."""
        return self.make is not None or bool(self.made and self.made[0][0] is not None)

    @property
    def checks(self) -> Checks:
        """What verify needs of it (a plan's bucket only)."""
        checks = self.built()[0]
        if checks is None:
            raise PlanError(f"bucket {self.index} was made outside a plan: it has no checks")
        return checks

    @property
    def credits(self) -> Credits:
        """What commit credits of it (a plan's bucket only)."""
        credits = self.built()[1]
        if credits is None:
            raise PlanError(f"bucket {self.index} was made outside a plan: it has no credits")
        return credits

    def built(self) -> tuple[Checks | None, Credits | None]:
        """The checks and credits, made now if not yet (two threads may both make them: the first kept); the
        maker, which holds the plan's context, is let go."""
        if not self.made:
            make = self.make
            self.made.append((None, None) if make is None else make())
            object.__setattr__(self, "make", None)
        return self.made[0]

    @property
    def is_built(self) -> bool:
        return bool(self.made) or self.make is None  # no maker: nothing to make


@dataclass(frozen=True, kw_only=True)
class Plan:
    key: Hashable
    buckets: tuple[Bucket, ...]
    nbytes: int
    ideal_bytes: int = 0  # the source bytes of the copies alone (what a perfect plan would read)
    seconds: float = 0.0  # time it took to build
    serial: int = field(default_factory=lambda: next(_SERIALS))  # unique per plan built in this process
    copies: tuple[Copy, ...] = ()  # every box copy (what a relay holds: planner.fanout.held_boxes)
    digest_geometry: str = ""  # DigestIndex.geometry (planner/checks.py) of the publications it plans
    digest_order: tuple[tuple[int, int, tuple[Any, ...]], ...] = ()  # DigestIndex.order: the shards it checks
    digest_count: int = 0  # digests in its vector
    digest_runs: DigestRuns | None = field(default=None, compare=False, repr=False)  # where they lie (its manifests)
    receiver: ReceiverLayout = field(compare=False, repr=False)  # what it was built for
    route: Route = field(compare=False, repr=False)  # how each parameter is written
    # what planner functions derive from the plan on first use, kept with it: the delta index
    # (planner.delta.delta_index), this rank's relay boxes and each relay layout's geometry (planner.fanout)
    derived: dict[Hashable, object] = field(default_factory=dict, compare=False, repr=False)

    def digests(self, pub: Publication, *, placed: bool = True) -> np.ndarray:
        """``pub``'s digests of the shards this plan reads, in the order its checks index them (a whole
        publication; an ``Outline``'s come from the registry: ``refit.digests.version_digests``); ``placed=False``:
        where the shards are is left to ``check_placed`` (``planner.vector.digest_vector``)."""
        return digest_vector(pub, self.digest_order, self.digest_count, placed=placed, runs=self.digest_runs)
