"""Verify: check pulled bytes against the publisher's digests where they landed, then release staging.

The plan holds each bucket's checks (``planner.checks``): the digest units its pieces hold and where their
bytes landed (staging, or the destination for direct pieces), as arrays. Verify hashes them on the
bytes' own device, off the event loop (``refit/hashes.py``), and compares with the version's digest vector
(decoded once per refit), by the algorithm the publisher chose for each shard (``core/hashing.py``): a
whole xxh3 unit is one C call; a mix64 piece is one batched torch pass; xxh3 tiles strided where they
landed are gathered. A unit split over pieces (a tile larger than a bucket) is completed across pieces
and buckets (xxh3 streams in plan order; mix64 adds sums). Bytes of units that never complete count as
unverified (possible only under ``verify="pulled"``; under ``"strict"`` the refit then fails).

A version announced before its digests (two-phase publication), or whose digests are taken beside the first
reads (``attempt.Placing``: nothing before the reads needed them), is hashed as it lands and each bucket held
here; the digests are asked for beside, and the held buckets compared and sent on, in order, once they are
in: commit sees no bucket whose bytes did not match.

Device work: the hashing runs on the bucket's refit streams (``DeviceLane.use``, in the worker thread),
and the staging lease is freed only after the bucket's marks (apply's copies out of it) are waited for.

Pieces that are not the trainer's own reads get a second chance within their bucket: bytes from an
upstream relay that do not match are read again from the trainer (the relay is not read again), and a
piece a delta refit skipped and re-hashes (``Work.recheck``; staged ones are first gathered back into
staging from where they lie) is read again if it differs (it was changed behind refitflow's back). The
second read goes the landing path of first reads (``refit/landing.py``: read, copies, write). Only bytes
the trainer itself sent that do not match are an ``IntegrityError``. With every unit of the buckets so far
complete, ``Work.verified_through`` moves on (relay progress, in commit)."""

from __future__ import annotations

import logging
import time
from collections import Counter

import anyio
import numpy as np

from refitflow.core.errors import IntegrityError
from refitflow.core.threads import off_loop
from refitflow.planner.delta import PULL
from refitflow.refit.attempt import Attempt, Meter, Resources
from refitflow.refit.digests import version_digests
from refitflow.refit.handoff import first_error, give, take
from refitflow.refit.hashes import Compare, HashState, check_bucket
from refitflow.refit.landing import piece_copies, read_pieces, write
from refitflow.refit.work import Receive, Send, Work

__all__ = ["INLINE_BYTES", "run"]

log = logging.getLogger(__name__)

# a bucket of at most this many bytes is hashed on the event loop's thread (≈ 50 µs of xxh3): a worker thread's
# hop costs more than that (the wake-ups of two threads: 70 µs on an idle 2-core machine, several hundred loaded)
INLINE_BYTES = 1 << 20


def _integrity_error(bad: list[str], version: int | None) -> IntegrityError:
    counts = Counter(bad)
    listed = ", ".join(f"{name!r} ({n} block{'s' if n > 1 else ''})" for name, n in list(counts.items())[:20])
    more = f" and {len(counts) - 20} more" if len(counts) > 20 else ""
    return IntegrityError(
        f"pulled bytes do not match the publisher's digests: {len(bad)} digest block(s) of "
        f"{len(counts)} tensor(s): {listed}{more}",
        tensor=bad[0],
        version=version,
    )


class _Digests:
    """The version's digest vector as verify has it: from the plan stage, or taken while the reads go on —
    ``take``: from beside the first reads (``Placing``), or (a version announced before its digests) once
    they follow, within ``read_timeout_s``."""

    def __init__(self, attempt: Attempt) -> None:
        self.attempt = attempt
        self.vec = attempt.digests
        self.arrived = anyio.Event()

    async def take(self) -> None:
        a = self.attempt
        if a.found.complete is None:  # taken beside the first reads (``Placing``)
            await a.placed()
            assert a.placing is not None and a.placing.vec is not None  # placed: taken
            vec = a.placing.vec
        else:  # a pending publication carries how to complete it
            pub = await a.found.complete()
            a.txn.revision = pub.revision
            vec = await version_digests(a.plan, pub)
            a.txn.holding = (a.plan.digest_geometry, vec)
        self.vec = vec
        self.arrived.set()


async def _second_chance(res: Resources, attempt: Attempt, work: Work, st: HashState, bad: list[int],
                         vec: np.ndarray) -> None:  # fmt: skip
    """Read again from the trainer the pieces whose bytes came from a relay or were skipped and re-hashed;
    ``IntegrityError`` if bytes the trainer sent differ (now, or before)."""
    relayed = set(work.relayed)
    skipped = set() if work.actions is None else set(np.flatnonzero(work.actions != PULL).tolist())
    pieces = sorted(set(bad))
    names = work.bucket.checks.names
    if not set(pieces) <= relayed | skipped:
        raise _integrity_error([names[k] for k in bad if k not in relayed | skipped], attempt.version)
    if relayed & set(pieces):
        assert attempt.upstream is not None  # relayed pieces came from it
        attempt.upstream.fail("its bytes do not match the trainer's digests")
    again = [k for k in pieces if k in skipped]
    if again:
        log.warning("%d skipped piece(s) of %s changed where they lie (behind refitflow's back): read again",
                    len(again), sorted({work.bucket.pieces[k].tensor for k in again})[:5])  # fmt: skip
    route = attempt.plan.route
    await read_pieces(res, attempt, work, pieces)
    per = piece_copies(res, work, route, attempt.replay) if work.bucket.staged else {}
    work.copies = [c for k in pieces for c in per.get(k, ())]
    await write(res, attempt.txn, work)  # marks the transaction written
    await res.devices.wait(work.marks)
    keep = np.zeros(len(work.bucket.pieces), dtype=bool)
    keep[pieces] = True
    still = (await off_loop(check_bucket, res, attempt, work, vec, st, keep, [])).bad
    if still:
        raise _integrity_error([names[k] for k in still], attempt.version)
    size = work.bucket.checks.piece_bytes
    work.pulled += int(size[pieces].sum())
    work.rerouted += int(size[[k for k in pieces if k in relayed]].sum())
    work.repaired += int(size[again].sum())


def _plan_checks(work: Work) -> tuple[np.ndarray | None, list[int], int]:
    """(pieces to check, staged re-hashed pieces to gather first, pulled bytes) of one bucket."""
    b = work.bucket
    if work.actions is None or work.recheck is None:
        return None, [], b.nbytes
    pulled = work.actions == PULL
    gather = [k for k in np.flatnonzero(work.recheck).tolist() if not b.pieces[k].direct]
    return pulled | work.recheck, gather, int(b.checks.piece_bytes[pulled].sum())


async def _free(res: Resources, work: Work) -> None:
    await res.devices.wait(work.marks)  # apply's copies out of staging are done: it may be reused
    if work.lease is not None:
        res.staging.free(work.lease)
        work.lease = None
    work.copies = []


async def run(
    res: Resources, attempt: Attempt, receive: Receive, send: Send, meter: Meter
) -> None:
    """Check every bucket, then send it on. For a version announced before its digests, each bucket is
    hashed as it lands and held here (its staging freed); the digests are asked for beside
    (``_Digests.take``), and the held buckets are compared and sent on, in order, once they are in."""
    st = HashState()
    pulled = 0
    held: list[tuple[Work, Compare, np.ndarray | None, int]] = []
    digests = _Digests(attempt)
    asked = False  # for the digests (``take``)

    async def settled(work: Work, keep: np.ndarray | None, nbytes: int) -> None:
        nonlocal pulled
        ch = work.bucket.checks
        if keep is None or work.actions is None:
            st.verified += ch.whole_bytes
        else:
            st.verified += int(ch.piece_checked[work.actions == PULL].sum())
        pulled += nbytes
        work.unverified = pulled - st.verified
        if not st.open:
            st.through = work.bucket.index
        work.verified_through = st.through
        await give(send, work)

    async def settle_held(vec: np.ndarray) -> None:
        await attempt.placed()
        while held:
            work, out, keep, nbytes = held.pop(0)
            bad = out.settle(vec)
            if bad:  # nothing came from a relay or was skipped: the trainer's bytes differ (IntegrityError)
                await _second_chance(res, attempt, work, st, bad, vec)
            await settled(work, keep, nbytes)

    try:
        async with receive, send, anyio.create_task_group() as tg:
            while (work := await take(receive)) is not None:
                meter.enter()
                t0 = time.perf_counter()
                if digests.vec is None and not asked:  # the version was announced before its digests
                    asked = True
                    tg.start_soon(digests.take)
                keep, gather, nbytes = _plan_checks(work)
                vec = digests.vec
                if work.bucket.nbytes <= INLINE_BYTES and not gather:  # a hop would cost more than the hashing
                    out = check_bucket(res, attempt, work, vec, st, keep, gather)
                else:
                    out = await off_loop(check_bucket, res, attempt, work, vec, st, keep, gather)
                now = vec is not None and not held  # compared before staging is freed: a second chance reads
                if now:  # into it
                    assert vec is not None
                    await attempt.placed()  # compared only with digests known to be of the shards read
                    bad = out.settle(vec)
                    if bad:
                        await _second_chance(res, attempt, work, st, bad, vec)
                await _free(res, work)
                meter.note(1, nbytes, time.perf_counter() - t0)
                if now:
                    await settled(work, keep, nbytes)
                    continue
                held.append((work, out, keep, nbytes))
                if digests.vec is not None:
                    await settle_held(digests.vec)
            if held:
                await digests.arrived.wait()
                assert digests.vec is not None  # arrived
                await settle_held(digests.vec)
            unverified = pulled - st.verified
            if res.limits.verify == "strict" and unverified:  # the plan promised whole units only
                raise IntegrityError(  # before commit sees the end of input
                    f"{unverified} pulled bytes were not covered by whole digest blocks under verify='strict'",
                    version=attempt.version,
                )
    except BaseExceptionGroup as group:  # the digests' task failed (or the loop did): its own error
        raise first_error(group) from None
