"""The receiver pipeline: eight stages joined by bounded streams in one task group.

    discover ─▶ plan ─▶ allocate ─▶ pull ─▶ translate ─▶ apply ─▶ verify ─▶ commit
                           │ budget.acquire                          │ budget.release

Backpressure comes from the bounded streams and the byte budget. A failure or cancellation in any
stage cancels the others and aborts the transaction under a cancellation shield; the caller gets
the stage's own ``RefitError`` (not an exception group).
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Hashable
from typing import Any

import anyio
from anyio.streams.memory import MemoryObjectSendStream

from refitflow.core.errors import RefitError
from refitflow.core.types import Identity, Publication
from refitflow.pipeline.transaction import Ledger, Transaction
from refitflow.stages import allocate, apply, commit, discover, plan, pull, translate, verify
from refitflow.stages._context import Discovery, StageContext

__all__ = ["Attempt", "run_pipeline"]


class Attempt:
    """The open transaction as the stages see it (``stages._context.Attempt``)."""

    def __init__(self, ledger: Ledger, txn: Transaction) -> None:
        self.ledger = ledger
        self.txn = txn
        self.version = txn.version

    def mark_written(self) -> None:
        self.txn.wrote = True

    def record(self, param: str, region: Hashable, numel: int) -> None:
        self.txn.coverage.record(param, region, numel)

    def credit(self, key: Hashable, params: tuple[str, ...], idx: Any, counts: Any) -> None:
        self.txn.coverage.credit(key, params, idx, counts)

    def hold(self, geometry: Hashable, digests: Any) -> None:
        self.txn.holding = (geometry, digests)

    def complete(self, revision: str) -> None:
        """The version was announced before its digests; now they are in: its content revision."""
        self.txn.revision = revision

    def prepare(self) -> None:
        self.ledger.prepare(self.txn)


Runner = Callable[..., Coroutine[Any, Any, None]]


def _guard(stage: str, ctx: StageContext, fn: Runner) -> Runner:
    """Run a stage; translate any foreign exception into a ``RefitError`` naming the stage."""

    async def guarded(*args: Any) -> None:
        try:
            await fn(ctx, *args)
        except (RefitError, anyio.get_cancelled_exc_class()):
            raise
        except Exception as exc:
            version = ctx.attempt.version if ctx.attempt is not None else None
            raise RefitError(f"{stage} stage failed: {type(exc).__name__}: {exc}", version=version) from exc

    return guarded


def _unwrap(group: BaseExceptionGroup) -> BaseException:
    """The first real error in a task group's exceptions (cancellations are echoes of it)."""
    cancelled = anyio.get_cancelled_exc_class()
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            exc = _unwrap(exc)
        if not isinstance(exc, cancelled):
            return exc
    return group.exceptions[0]


async def run_pipeline(
    ctx: StageContext,
    *,
    ledger: Ledger,
    registry: Discovery,
    identity: Identity,
    min_version: int,
    discover_timeout: float,
    cache: plan.PlanCache,
    depth: int,
) -> Transaction:
    """Run one refit to a prepared transaction; abort it (shielded) on any failure or cancellation."""
    opened: list[Transaction] = []

    def begin(pub: Publication) -> None:
        txn = ledger.begin(pub.version, pub.revision)
        opened.append(txn)
        ctx.attempt = Attempt(ledger, txn)
        if ctx.fanout is not None:
            ctx.fanout.begin(pub.version)

    s_pub, r_pub = anyio.create_memory_object_stream[Publication](1)
    s_plan, r_plan = anyio.create_memory_object_stream[Any](depth)
    s_alloc, r_alloc = anyio.create_memory_object_stream[Any](depth)
    s_pull, r_pull = anyio.create_memory_object_stream[Any](depth)
    s_tr, r_tr = anyio.create_memory_object_stream[Any](depth)
    s_app, r_app = anyio.create_memory_object_stream[Any](depth)
    s_ver, r_ver = anyio.create_memory_object_stream[Any](depth)
    queues = {"plan": s_pub, "allocate": s_plan, "pull": s_alloc, "translate": s_pull, "apply": s_tr}
    queues |= {"verify": s_app, "commit": s_ver}
    ctx.observer.queues({k: _stats(v) for k, v in queues.items()})
    try:
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(
                    _guard("discover", ctx, discover.run),
                    registry,
                    identity,
                    min_version,
                    discover_timeout,
                    begin,
                    s_pub,
                )
                tg.start_soon(_guard("plan", ctx, plan.run), cache, r_pub, s_plan)
                tg.start_soon(_guard("allocate", ctx, allocate.run), r_plan, s_alloc)
                tg.start_soon(_guard("pull", ctx, pull.run), r_alloc, s_pull)
                tg.start_soon(_guard("translate", ctx, translate.run), r_pull, s_tr)
                tg.start_soon(_guard("apply", ctx, apply.run), r_tr, s_app)
                tg.start_soon(_guard("verify", ctx, verify.run), r_app, s_ver)
                tg.start_soon(_guard("commit", ctx, commit.run), r_ver)
        except BaseExceptionGroup as group:
            err = _unwrap(group)
            raise err from err.__cause__
    except BaseException as exc:
        # shielded: nothing in the abort path may be interrupted (it is synchronous today; a later
        # engine-wide abort that awaits stays inside this scope)
        with anyio.CancelScope(shield=True):  # noqa: ASYNC100
            ctx.staging.free_all()
            if opened:
                reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                ledger.abort(opened[0], reason)
        raise
    finally:
        ctx.observer.queues({})
    return opened[0]


def _stats(stream: MemoryObjectSendStream[Any]) -> Callable[[], tuple[int, int]]:
    def read() -> tuple[int, int]:
        s = stream.statistics()
        return s.current_buffer_used, int(s.max_buffer_size)

    return read
