"""Plan: make the attempt — the plan for what discover found, the version's digests, what a delta refit
leaves, whom to read from — then hand its buckets downstream in order.

The plan itself comes from the planner (``refitflow.planner``), cached with its replay state
(``refit/plans.py``). A version announced before its digests is read whole and from the trainer (verify
takes the digests when they follow): nothing is skipped and no relay is joined for it.
"""

from __future__ import annotations

import time

import numpy as np

from refitflow.core.records import Outline
from refitflow.core.threads import off_loop
from refitflow.planner import vector
from refitflow.planner.delta import Skips, decide, delta_index
from refitflow.planner.records import Bucket, Plan
from refitflow.refit.attempt import Attempt, Found, Meter, Placing, Resources
from refitflow.refit.digests import version_digests
from refitflow.refit.handoff import give
from refitflow.refit.work import Send, Work

__all__ = ["check_placed", "run", "start"]


async def start(res: Resources, found: Found, meter: Meter) -> Attempt:
    """The attempt for ``found``: its plan (cached, or built off the event loop), and unless the version was
    announced before its digests, the upstream relay, the delta decision and — where either needs them before
    the reads — the digests (else they are taken beside the first reads: ``Placing``)."""
    meter.enter()
    t0 = time.perf_counter()
    pub, txn = found.publication, found.txn
    plan, replay = await res.plans.get(pub, res.destination, res.limits)
    digests = skips = upstream = placing = None
    if not pub.pending:  # else verify takes the digests when they follow (nothing skipped, no relays)
        if res.fanout is not None:
            upstream = await res.fanout.join(plan, txn.version)
        whole = not isinstance(pub, Outline)  # a registry's outline is checked where it is fetched
        if res.limits.skip_unchanged or upstream is not None:  # a decision before the reads needs the digests
            digests = await version_digests(plan, pub, placed=False)
            txn.holding = (plan.digest_geometry, digests)
            if res.limits.skip_unchanged:
                skips = await _skips(res, plan, digests, txn.version)
        if whole or digests is None:  # where the shards are, or the digests themselves: beside the first reads
            placing = Placing(check=whole)
    meter.note(len(plan.buckets), plan.nbytes, time.perf_counter() - t0)
    return Attempt(found=found, plan=plan, replay=replay, digests=digests, skips=skips, upstream=upstream,
                   placing=placing)  # fmt: skip


async def check_placed(attempt: Attempt) -> None:
    """What ``start`` left for beside the first reads (``Placing``): where the shards are, and the digests."""
    placing, plan = attempt.placing, attempt.plan
    if placing is None:
        return
    if attempt.digests is None:
        placing.vec = await version_digests(plan, attempt.publication)  # checked where they are (placed)
        attempt.txn.holding = (plan.digest_geometry, placing.vec)
    elif placing.check:
        await off_loop(vector.check_placed, attempt.publication, plan.digest_order)
    placing.done.set()


async def run(res: Resources, attempt: Attempt, send: Send, meter: Meter) -> None:
    """Send the plan's buckets downstream in order, with this refit's delta decision for each."""
    skips = attempt.skips
    buckets = attempt.plan.buckets
    async with send:
        for bucket in buckets:
            if not bucket.is_built:  # a new plan: its checks are made as its buckets go, the first read
                await off_loop(_build_ahead, buckets, bucket.index)
            actions, recheck = skips.of(bucket.index) if skips is not None else (None, None)
            await give(send, Work(bucket, actions=actions, recheck=recheck))


def _build_ahead(buckets: tuple[Bucket, ...], first: int) -> None:
    """The checks of ``buckets[first]`` and of those after it, for about a millisecond (a hop each)."""
    t0 = time.perf_counter()
    for b in buckets[first:]:
        b.built()
        if time.perf_counter() - t0 > 0.001:
            break


async def _skips(res: Resources, plan: Plan, digests: np.ndarray, version: int) -> Skips | None:
    """This refit's delta decision (None: every piece is pulled), the plan's index built on first use."""
    dest = res.destination
    target, live = dest.holding("target"), dest.holding("live")
    if target is None and live is None:
        return None
    index = delta_index(plan) if "delta" in plan.derived else await off_loop(delta_index, plan)
    return decide(index, plan.digest_geometry, digests, target, live, turn=version,
                  recheck_fraction=res.limits.recheck_fraction)  # fmt: skip
