"""StreamReceiver: an inference rank taking each version the trainer pushes, transactionally.

One ``prepare`` takes one stream, header to end marker, and runs it through the refit's own
parts: the first header **begins** a transaction on the rank's ``Ledger`` (version rules of the
pull path); each bucket's payload is leased from the byte budget's arena (one bucket resident at a
time, freed before the next is leased), its entries are checked and mapped (``_map.EntryMap``)
and then translated, applied and credited to coverage by the pull path's stages; at the end marker
the transaction is **prepared** (coverage). ``finish``/``abort`` (or an ``EngineMember`` vote
between them) complete it, exactly as for a pulling ``Receiver``.

Staying in step with the sender and the other ranks: a rank whose bucket fails (a refused frame,
an unknown name, a shape mismatch, a refused begin, a failed write) still takes every broadcast up
to the end marker, applies nothing more, and raises the first failure there. A header whose sizes
pass the ceilings (metadata ≤ 64 MiB, payload ≤ the budget) is always received by those sizes; one
that fails them, or whose buffer cannot be allocated, cannot be received at all: the rank leaves
the group (``OutOfStepError``), as it does when a broadcast fails or the attempt is cancelled
mid-stream.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import anyio
import torch

from refitflow.core.errors import ConfigError, FrameError, OutOfStepError, PlanError, RefitError, VersionError
from refitflow.layouts.boxes import volume
from refitflow.layouts.canonical import LocalTensor
from refitflow.metrics import NULL_OBSERVER, Observer
from refitflow.planner.limits import Limits
from refitflow.planner.routes import Job, Route
from refitflow.push._map import EntryMap
from refitflow.push.config import StreamReceiverConfig
from refitflow.push.format import CMD_BUCKET, CMD_END, HEADER_DTYPE, METADATA_CEILING, Header, decode_metadata
from refitflow.push.group import StreamGroup
from refitflow.refit.arena import Lease, StagingArenas
from refitflow.refit.attempt import STAGES, Meter, Resources
from refitflow.refit.landing import copies_of, write
from refitflow.refit.plans import PlanCache
from refitflow.refit.rank import RankState
from refitflow.refit.results import ReceiverStatus, RefitResult, StageStats
from refitflow.refit.stages.commit import credit
from refitflow.refit.transaction import Transaction
from refitflow.refit.work import Work

__all__ = ["StreamReceiver"]


class StreamReceiver:
    def __init__(
        self,
        model: torch.nn.Module | Mapping[str, torch.Tensor],
        group: StreamGroup,
        *,
        mode: str = "in_place",
        budget_bytes: int = StreamReceiverConfig.budget_bytes,
        observer: Observer = NULL_OBSERVER,
        layout: Mapping[str, LocalTensor] | None = None,
        source_layout: Mapping[str, LocalTensor] | None = None,
        lossy_casts: bool = False,
        src: int = 0,
    ) -> None:
        self.config = StreamReceiverConfig(budget_bytes=budget_bytes, mode=mode, lossy_casts=lossy_casts, src=src)  # type: ignore[arg-type]
        if group.rank == src:
            raise ConfigError(f"group rank {src} is the sender; a receiver must be another rank")
        self.group = group
        self.observer = observer
        rank = RankState.build(model, self.config.mode, layout, self.config.budget_bytes, observer)
        self.destination, self.fence, self.budget, self.ledger = rank.destination, rank.fence, rank.budget, rank.ledger
        self.devices = rank.devices
        self.arena = StagingArenas(self.budget, [group.device])  # the payload lands on the group's device
        self.entries = EntryMap(self.destination, source_layout, self.config.lossy_casts)
        # entries are mapped by the stream itself (push/_map.py): of a route, only the quantised jobs are used
        d = self.destination
        jobs = {p: Job(p, q, ((p, d.expected[p]),)) for p, q in d.quantised.items()}
        self.route = Route({}, frozenset(jobs), jobs=jobs)

    @property
    def status(self) -> ReceiverStatus:
        return ReceiverStatus.of(self.ledger)

    async def refit(self, min_version: int | None = None, *, timeout: float = 60.0) -> RefitResult:
        """Take the next stream and commit it (no engine vote); see ``prepare``."""
        txn, result = await self.prepare(min_version, timeout=timeout)
        await self.finish(txn)
        return result

    async def prepare(
        self, min_version: int | None = None, *, timeout: float = 60.0
    ) -> tuple[Transaction, RefitResult]:
        """Take one stream to its end marker: a prepared transaction, nothing visible yet.

        ``timeout``: how long to wait for the stream's first header (later frames: the group's
        timeout). A stream older than ``min_version`` (default: newer than the last begun) is
        refused (``VersionError``) and drained. Call ``finish`` or ``abort`` next.
        """
        floor = min_version if min_version is not None else (self.ledger.last_begun or 0) + 1
        self.budget.reset_peak()
        stream = _Stream(self, floor)
        try:
            txn = await stream.run(timeout)
        except BaseException as exc:
            stream.ended_badly(exc)  # synchronous: nothing in it can be interrupted
            raise
        finally:
            self.observer.queues({})  # the attempt ended: nothing is in flight in any stage
        return txn, stream.result(txn)

    async def finish(self, txn: Transaction) -> None:
        """Make a prepared version visible."""
        self.ledger.finish(txn)
        self.observer.refit_outcome("committed", txn.version)

    async def abort(self, txn: Transaction, reason: str) -> None:
        """Abandon a prepared version (e.g. a peer of the engine was not ready)."""
        self.ledger.abort(txn, reason)
        self.observer.refit_outcome("aborted", txn.version)


class _Stream:
    """One stream, header to end marker, on one rank."""

    def __init__(self, recv: StreamReceiver, floor: int) -> None:
        self.recv, self.floor, self.group, self.src = recv, floor, recv.group, recv.config.src
        limits = Limits(
            bucket_bytes=recv.budget.capacity_bytes, direct_bucket_bytes=recv.budget.capacity_bytes,
            max_reads_per_bucket=1, lossy_casts=recv.config.lossy_casts, read_timeout_s=recv.group.timeout_s,
        )  # fmt: skip
        self.res = Resources(
            destination=recv.destination, staging=recv.arena, devices=recv.devices, ledger=recv.ledger,
            limits=limits, plans=PlanCache(0), observer=recv.observer,
        )  # fmt: skip
        self.meters = {stage: Meter(stage, recv.observer) for stage in STAGES}
        self.version: int | None = None
        self.txn: Transaction | None = None
        self.failure: RefitError | None = None  # the first one: raised at the end marker
        self.ended = False  # the end marker arrived: in step with the sender
        self.assembled: dict[str, int] = {}  # float8 parameters' elements so far (commit stage)
        self.tied: dict[str, str] = {}  # tied tensor -> the name it came under
        self.buckets = self.nbytes = self.ideal = 0
        self.misses = recv.entries.misses
        self.t0 = self.waited = 0.0

    async def run(self, first_timeout: float) -> Transaction:
        t_wait = time.perf_counter()
        discover = self.meters["discover"]
        discover.enter()
        header = await self._header(first_timeout)
        self.t0 = time.perf_counter()
        self.waited = self.t0 - t_wait
        self._begin(header.version)
        discover.note(1, 0, time.perf_counter() - self.t0)
        while header.command != CMD_END:
            await self._frame(header)
            header = await self._header(None)
        self.ended = True
        if header.metadata_bytes or header.payload_bytes:
            self._refuse(FrameError(f"the end marker carries sizes {list(header)[1:3]}", kind="header",
                                    version=self.version))  # fmt: skip
        if self.failure is not None:
            raise self.failure
        assert self.txn is not None  # begun, or the failure was raised
        self.recv.ledger.prepare(self.txn)  # coverage: every parameter written exactly once
        return self.txn

    def _begin(self, version: int) -> None:
        self.version = version
        try:
            if version < self.floor:
                raise VersionError(f"the stream carries version {version}, older than the {self.floor} asked for",
                                   version=version)  # fmt: skip
            self.txn = self.recv.ledger.begin(version, "")
        except VersionError as exc:
            self._refuse(exc, "version")

    def _refuse(self, exc: RefitError, kind: str | None = None) -> None:
        """Record a failure (a refused frame: a ``FrameError`` or a ``kind``); the stream is still received."""
        kind = exc.kind if isinstance(exc, FrameError) else kind
        if kind is not None:
            self.recv.observer.frame_refused(kind)
        if self.failure is None:
            self.failure = exc

    def _out_of_step(self, why: str) -> OutOfStepError:
        self.group.close()
        return OutOfStepError(f"{why}; left the stream group", version=self.version)

    async def _header(self, timeout: float | None) -> Header:
        raw = torch.empty(4, dtype=HEADER_DTYPE, device=self.group.device)
        await self.group.broadcast(raw, self.src, timeout)
        h = Header(*(int(x) for x in raw.tolist()))
        capacity = self.recv.budget.capacity_bytes
        fits = 0 <= h.metadata_bytes <= METADATA_CEILING and 0 <= h.payload_bytes <= capacity
        if h.command != CMD_END and not fits:
            self.recv.observer.frame_refused("ceiling")
            raise self._out_of_step(
                f"a header announces {h.metadata_bytes} metadata and {h.payload_bytes} payload bytes; "
                f"this rank takes at most {METADATA_CEILING} and {capacity} (its budget)"
            )
        if self.version is not None and h.version != self.version:
            self._refuse(FrameError(f"a header carries version {h.version} inside the stream of version {self.version}",
                                    kind="header", version=self.version))  # fmt: skip
        return h

    async def _frame(self, h: Header) -> None:
        metadata = await self._metadata(h.metadata_bytes)
        lease = await self._payload(h.payload_bytes)
        work = None
        try:
            if h.command != CMD_BUCKET:
                self._refuse(FrameError(f"unknown command {h.command}", kind="command", version=self.version))
            elif self.failure is None:  # after a failure: received to stay in step, never applied
                work = await self._write(metadata, lease, h.payload_bytes)
        finally:
            with anyio.CancelScope(shield=True):  # copies out of the payload are done before it is reused
                await self.recv.devices.drain()
            self.recv.arena.free(lease)  # before the next bucket is leased
        if work is not None:
            assert self.txn is not None  # buckets are written only after a begin
            try:
                await self._step("commit", h.payload_bytes, credit, self.res, self.txn, self.recv.route, work,
                                 self.assembled)  # fmt: skip
            except RefitError as exc:
                self._refuse(exc)

    async def _metadata(self, n: int) -> bytes:
        try:
            buf = torch.empty(n, dtype=torch.uint8, device=self.group.device)
        except RuntimeError as exc:
            raise self._out_of_step(f"could not allocate {n} bytes of metadata: {exc}") from exc
        await self.group.broadcast(buf, self.src)
        return buf.cpu().numpy().tobytes()

    async def _payload(self, n: int) -> Lease:
        allocate, pull = self.meters["allocate"], self.meters["pull"]
        allocate.enter()
        t0 = time.perf_counter()
        try:
            lease = await self.recv.arena.allocate(n, str(self.group.device))
        except RuntimeError as exc:  # the arena's buffer (the budget) could not be allocated
            cap = self.recv.budget.capacity_bytes
            raise self._out_of_step(f"could not allocate the {cap}-byte budget: {exc}") from exc
        allocate.note(1, n, time.perf_counter() - t0)
        pull.enter()
        t0 = time.perf_counter()
        await self.group.broadcast(lease.view, self.src)  # failing, it leaves: ended_badly frees the lease
        self.recv.observer.transport_read("stream", n, time.perf_counter() - t0)
        pull.note(1, n, time.perf_counter() - t0)
        self.nbytes += n
        return lease

    async def _write(self, metadata: bytes, lease: Lease, n: int) -> Work | None:
        """Check and map every entry, then translate and apply the bucket; ``None`` if it failed."""
        assert self.version is not None and self.txn is not None  # buckets are written only after a begin
        plan = self.meters["plan"]
        plan.enter()
        t0 = time.perf_counter()
        try:
            entries = decode_metadata(metadata, n, version=self.version)
            bucket = self.recv.entries.bucket(self.buckets, entries, n, self.version, self.tied, str(self.group.device))
        except FrameError as exc:
            self._refuse(exc)
            return None
        except PlanError as exc:
            self._refuse(exc, "mapping")
            return None
        plan.note(1, n, time.perf_counter() - t0)
        self.buckets += 1
        self.ideal += sum(volume(s.sub) * p.nbytes // max(volume(p.box), 1) for p in bucket.pieces for s in p.scatters)
        work = Work(bucket, lease=lease)
        try:
            await self._step("translate", n, self._translate, work)
            await self._step("apply", n, write, self.res, self.txn, work)
        except RefitError as exc:
            self._refuse(exc)
            return None
        work.copies = []
        return work

    async def _translate(self, work: Work) -> None:
        work.copies = copies_of(self.res, work, self.recv.route, None)

    async def _step(self, stage: str, nbytes: int, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        """Run one stage's work on a bucket, accounted as the pull path's stages are."""
        meter = self.meters[stage]
        meter.enter()
        t0 = time.perf_counter()
        try:
            await fn(*args)
            meter.note(1, nbytes, time.perf_counter() - t0)
        except RefitError:
            raise
        except Exception as exc:
            raise RefitError(f"{stage} stage failed: {type(exc).__name__}: {exc}", version=self.version) from exc

    def ended_badly(self, exc: BaseException) -> None:
        """Leave nothing half-done: out of the group if mid-stream, staging freed, the attempt aborted."""
        if not self.ended:
            self.group.close()  # mid-stream (cancelled, failed broadcast, ceiling): out of step for good
        self.recv.arena.free_all()
        if self.txn is not None:
            self.recv.ledger.abort(self.txn, f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
        self.recv.observer.refit_outcome("aborted" if self.txn is not None else "refused", self.version)

    def result(self, txn: Transaction) -> RefitResult:
        stats = self.recv.budget.statistics()
        return RefitResult(
            version=txn.version, revision=txn.revision, nbytes=self.nbytes, ideal_bytes=self.ideal,
            unverified_bytes=self.nbytes, direct_bytes=0, seconds=time.perf_counter() - self.t0,
            wait_seconds=self.waited, plan_cached=self.recv.entries.misses == self.misses,
            peak_staging_bytes=stats.peak_bytes,
            stages={k: StageStats(items=m.items, nbytes=m.nbytes, seconds=m.seconds) for k, m in self.meters.items()
                    if m.noted},
        )  # fmt: skip
