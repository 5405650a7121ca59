"""Commit: credit every verified bucket to coverage; at the end of input, prepare.

A bucket's credits (elements per parameter) were computed with the plan: crediting one is a
constant amount of Python whatever its number of tensors.

Preparing checks that every destination parameter was written exactly once (a fused parameter
counts only when every box of it arrived, whichever buckets they came in; a parameter assembled first —
quantised, or converted from a quantised publication (``planner/routes.py``) — is written here once its
assemblies are complete, and its scales credited as derived) and makes nothing
visible; the pipeline's owner finishes (or, after an engine vote, aborts) it. Before preparing, every
refit stream is drained (``DeviceLane.drain``, off the event loop): a prepared version has no byte in flight.

A relay (``Resources.fanout``) learns each bucket's elements once every digest unit up to that bucket is
verified (``Work.verified_through``: a unit split over buckets is complete only with its last part), and
marks the tensors they complete as served (``refit/fanout/relaying.py``): this is where a verified bucket is
handed to the relay's readers. Commit also adds up what each bucket counted (``Tally``).
"""

from __future__ import annotations

import time

import anyio.to_thread

from refitflow.layouts.boxes import volume
from refitflow.planner.checks import Credits
from refitflow.planner.routes import Job, Route
from refitflow.refit.attempt import Attempt, Meter, Resources, Tally
from refitflow.refit.convert import run_job
from refitflow.refit.handoff import take
from refitflow.refit.transaction import Transaction
from refitflow.refit.work import Receive, Work

__all__ = ["credit", "run"]


def _run(res: Resources, job: Job) -> None:
    """A complete job, on its parameter's refit stream (where its assemblies were made)."""
    with res.devices.use((res.destination.params[job.param].device,)):
        run_job(res.destination, job)


async def credit(
    res: Resources, txn: Transaction, route: Route, work: Work, assembled: dict[str, int], serial: int = -1
) -> None:
    """Credit one bucket's destination boxes; run each job (``planner/routes.py``) its boxes complete.

    A planned bucket carries its credits (elements per parameter, computed with the plan: O(1) Python
    per bucket; ``serial``: its plan's); a bucket made outside a plan (the push stream) is credited box by
    box, so a box that arrives twice is caught. ``assembled``: assembly -> elements assembled so far (per
    attempt).
    """
    b = work.bucket
    if b.planned:
        c = b.credits
        txn.coverage.credit((serial, b.index), c.params, c.idx, c.counts)
        derived = b.derived
    else:
        for p in b.pieces:
            for s in p.scatters:
                txn.coverage.record(s.param, s.dbox, volume(s.dbox))
        derived = tuple(s for p in b.pieces for s in p.scatters if s.param in route.assembled)
    dest = res.destination
    for s in derived:  # run a job once every element of every assembly it needs arrived (padding excluded)
        assembled[s.param] = assembled.get(s.param, 0) + volume(s.dbox)
        job = route.jobs[s.param]
        if any(assembled.get(n, 0) != k for n, k in job.needs):
            continue
        txn.wrote = True
        await anyio.to_thread.run_sync(_run, res, job)
        if job.param in route.converted:
            txn.coverage.record(job.param, "derived", dest.expected[job.param])
        for n in job.quant.derived if job.quant is not None else ():
            txn.coverage.record(n, "derived", dest.params[n].numel())


async def run(res: Resources, attempt: Attempt, receive: Receive, tally: Tally, meter: Meter) -> None:
    """Credit the buckets as they come, add up their counts into ``tally``; at the end, drain and prepare."""
    assembled: dict[str, int] = {}
    owed: list[tuple[int, Credits]] = []  # (bucket index, credits) a relay has not served yet
    fanout, route, txn = res.fanout, attempt.plan.route, attempt.txn
    async with receive:
        while (work := await take(receive)) is not None:
            meter.enter()
            t0 = time.perf_counter()
            await credit(res, txn, route, work, assembled, attempt.plan.serial)
            tally.pulled += work.pulled
            tally.relayed += work.relay_bytes
            tally.rerouted += work.rerouted
            tally.repaired += work.repaired
            tally.unverified = work.unverified
            if fanout is not None:
                owed.append((work.bucket.index, work.bucket.credits))
                while owed and owed[0][0] <= work.verified_through:
                    fanout.verified(owed.pop(0)[1])
            meter.note(1, work.bucket.nbytes, time.perf_counter() - t0)
    for _, credits in owed:  # every bucket was verified
        assert fanout is not None  # owed only with one
        fanout.verified(credits)
    t0 = time.perf_counter()
    await res.devices.drain()  # nothing still in flight on a device when the version is prepared
    await attempt.placed()  # the digests' shards where the plan put them (nothing to compare: verify off)
    res.ledger.prepare(txn)
    meter.note(0, 0, time.perf_counter() - t0, item=False)
