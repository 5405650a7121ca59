"""The receiver pipeline of one refit attempt: discover, plan, then six stages joined by bounded streams.

    discover ─▶ plan ─▶ allocate ─▶ pull ─▶ translate ─▶ apply ─▶ verify ─▶ commit
                           │ budget.acquire                          │ budget.release

Discover finds a publication and begins its transaction (``Found``); plan makes the attempt from it
(``Attempt``: plan, digests, delta decision, upstream relay); then the plan's buckets flow, one ``Work`` per
bucket, through the stage tasks, each of which is handed the attempt. Backpressure comes from the bounded
streams and the byte budget. A failure or cancellation anywhere cancels the others and aborts the
transaction under a cancellation shield — staging freed, the version abandoned (``_abort``: where a failed
refit's staging is released); the caller gets the stage's own ``RefitError`` (not an exception group). A
prepared attempt comes back as an ``Outcome``, from which the receiver makes its ``RefitResult``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio

from refitflow.core.errors import RefitError
from refitflow.core.types import Identity, Publication
from refitflow.refit.attempt import STAGES, Attempt, Found, Meter, Resources, Tally
from refitflow.refit.handoff import Sending, channel, first_error
from refitflow.refit.stages import allocate, apply, commit, discover, plan, pull, translate, verify
from refitflow.refit.transaction import Transaction
from refitflow.refit.work import Receive, Send
from refitflow.registry.protocol import Discovery

__all__ = ["Outcome", "run_pipeline"]

T = TypeVar("T")


@dataclass(frozen=True, kw_only=True, eq=False)
class Outcome:
    """A prepared attempt: what it read and how (``tally``), and each stage's work (``meters``)."""

    attempt: Attempt
    tally: Tally
    meters: dict[str, Meter]

    @property
    def txn(self) -> Transaction:
        return self.attempt.txn


async def _guarded(stage: str, version: int | None, work: Awaitable[T]) -> T:
    """Await a stage; translate any foreign exception into a ``RefitError`` naming the stage (but the echo of
    another stage's failure: its stream closed under it, ``first_error`` passes over that)."""
    try:
        return await work
    except (RefitError, anyio.BrokenResourceError, anyio.get_cancelled_exc_class()):
        raise
    except Exception as exc:
        raise RefitError(f"{stage} stage failed: {type(exc).__name__}: {exc}", version=version) from exc


async def run_pipeline(
    res: Resources,
    *,
    registry: Discovery,
    identity: Identity,
    min_version: int,
    discover_timeout: float,
    depth: int,
) -> Outcome:
    """Run one refit to a prepared transaction; abort it (shielded) on any failure or cancellation."""
    meters = {stage: Meter(stage, res.observer) for stage in STAGES}
    opened: list[Transaction] = []

    def begin(pub: Publication) -> Transaction:
        txn = res.ledger.begin(pub.version, pub.revision)
        opened.append(txn)
        if res.fanout is not None:
            res.fanout.begin(pub.version)
        return txn

    def pipe() -> tuple[Send, Receive]:
        return channel(depth)

    s_plan, r_plan = pipe()
    s_alloc, r_alloc = pipe()
    s_pull, r_pull = pipe()
    s_tr, r_tr = pipe()
    s_app, r_app = pipe()
    s_ver, r_ver = pipe()
    queues = {"allocate": s_plan, "pull": s_alloc, "translate": s_pull, "apply": s_tr, "verify": s_app}
    res.observer.queues({k: _stats(v) for k, v in (queues | {"commit": s_ver}).items()})
    tally = Tally()
    try:
        try:
            found: Found = await _guarded("discover", None, discover.run(
                res, registry, identity, min_version, discover_timeout, begin, meters["discover"]))  # fmt: skip
            version = found.txn.version
            attempt = await _guarded("plan", version, plan.start(res, found, meters["plan"]))

            def task(stage: str, fn: Callable[..., Coroutine[Any, Any, None]], *args: Any) -> Callable[[], Any]:
                return lambda: _guarded(stage, version, fn(*args, meters[stage]))

            async with anyio.create_task_group() as tg:
                tg.start_soon(task("plan", plan.run, res, attempt, s_plan))
                tg.start_soon(_guarded, "plan", version, plan.check_placed(attempt))
                tg.start_soon(task("allocate", allocate.run, res, r_plan, s_alloc))
                tg.start_soon(task("pull", pull.run, res, attempt, r_alloc, s_pull))
                tg.start_soon(task("translate", translate.run, res, attempt, r_pull, s_tr))
                tg.start_soon(task("apply", apply.run, res, attempt, r_tr, s_app))
                tg.start_soon(task("verify", verify.run, res, attempt, r_app, s_ver))
                tg.start_soon(task("commit", commit.run, res, attempt, r_ver, tally))
        except BaseExceptionGroup as group:
            err = first_error(group)
            raise err from err.__cause__
    except BaseException as exc:
        _abort(res, opened, exc)
        raise
    finally:
        res.observer.queues({})
    return Outcome(attempt=attempt, tally=tally, meters=meters)


def _abort(res: Resources, opened: list[Transaction], exc: BaseException) -> None:
    """A failed or cancelled attempt: its staging released, its transaction (if begun) aborted. Synchronous,
    so nothing can interrupt it (a later engine-wide abort that awaits must run under a shield)."""
    res.staging.free_all()
    if opened:
        reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        res.ledger.abort(opened[0], reason)


def _stats(stream: Sending[Any]) -> Callable[[], tuple[int, int]]:
    return stream.statistics
