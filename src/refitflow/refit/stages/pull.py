"""Pull: read each bucket's pieces, straight into parameters or into staging, many buckets in flight.

Which pieces are read, and from where: every piece from its trainer rank, except pieces a delta refit
leaves (``Work.actions``, ``planner/delta.py``) and pieces the attempt's upstream relay holds
(``fanout.reading``: read once the relay has verified them; what it cannot deliver is read from the trainer).

Two tasks: one *submits* each bucket's trainer reads as it comes (``landing.submit_pieces``: the transport
posts them and returns at once) — and its relayed reads with them once the relay's status shows them verified
(``fanout.reading.submit_ahead``, strict verify: the submitter waits for the relay) — and hands it on; the other
waits for the buckets in order — each until ``read_timeout_s`` after it was submitted —, takes the relayed
pieces still owed (another verify mode, or a relay that failed), and sends each bucket on. At most
``Resources.window`` buckets are in flight between the two; staged buckets are bounded by the staging budget too
(allocate), direct ones by the window alone. A transport that posts from a thread of its own (NIXL) thus keeps
reading while the loop verifies and applies, and the loop is woken per bucket that ended, not per hop.
On the way out (a failure, a cancellation) every read still in flight is waited for, under a shield and a
deadline, before the stage ends, and the stages after it are not told the input ended (they are cancelled with
the refit), so nothing downstream mistakes a failure for the end. A read still in flight at that deadline (a
peer that stopped answering) is abandoned, not cut short — NIXL cannot cancel a READ on the wire, and its bytes
land whenever the peer answers —, so the next attempt's pull first waits for it to end (``Transport.quiesce``)
before it reads into the same parameters and staging; within ``read_timeout_s``, else it fails (typed, nothing
written: the rank serves what it served) and the one after waits again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import anyio
import numpy as np

from refitflow.core.errors import RefitTimeoutError, TransportError
from refitflow.planner.delta import PULL
from refitflow.planner.fanout import RelayPiece
from refitflow.refit.attempt import Attempt, Meter, Resources
from refitflow.refit.fanout.reading import Ahead, land_ahead, owed_by_upstream, submit_ahead, take_relayed
from refitflow.refit.handoff import Receiving, Sending, channel, first_error, give, take
from refitflow.refit.landing import landed, submit_pieces
from refitflow.refit.work import Receive, Send, Work
from refitflow.transports.base import Submitted, settle_or_abandon

__all__ = ["run"]


@dataclass(eq=False, slots=True)
class _Flight:
    work: Work
    pull: list[int]  # the pieces pulled (the rest a delta refit leaves)
    owed: dict[int, RelayPiece]  # of those, the upstream relay's
    submitted: Submitted | None  # the trainer's part, in flight
    ahead: Ahead | None  # the relay's part, in flight when the relay had it verified already
    t0: float  # perf_counter when submitted


def _writes_directly(work: Work) -> bool:
    """Whether the bucket's reads land straight in destination tensors."""
    if work.actions is None:
        return bool(work.bucket.direct_bytes)
    return any(p.direct and a == PULL for p, a in zip(work.bucket.pieces, work.actions.tolist(), strict=True))


async def _submit(res: Resources, attempt: Attempt, work: Work) -> _Flight:
    b = work.bucket
    pull = list(range(len(b.pieces))) if work.actions is None else np.flatnonzero(work.actions == PULL).tolist()
    owed = owed_by_upstream(attempt, work, pull)
    mine = [k for k in pull if k not in owed]
    if _writes_directly(work):
        attempt.txn.wrote = True
    t0 = time.perf_counter()
    submitted = await submit_pieces(res, attempt, work, mine) if mine else None
    ahead = await submit_ahead(res, attempt, work, owed) if owed else None
    return _Flight(work, pull, owed, submitted, ahead, t0)


async def _land(res: Resources, attempt: Attempt, f: _Flight) -> None:
    """Wait for a bucket's trainer reads, then read its relayed pieces; count what was pulled."""
    work, b = f.work, f.work.bucket
    if f.submitted is not None:
        await landed(res, attempt, work, f.submitted, f.t0)
    if f.ahead is not None:
        await land_ahead(res, attempt, work, f.ahead, f.owed)
    if f.owed:
        await take_relayed(res, attempt, work, f.owed)
    work.pulled += int(b.checks.piece_bytes[f.pull].sum()) if len(f.pull) < len(b.pieces) else b.nbytes


async def run(res: Resources, attempt: Attempt, receive: Receive, send: Send, meter: Meter) -> None:
    assert res.transport is not None  # a pulling rank has one
    name = res.transport.name
    flying: list[_Flight] = []  # submitted, not yet landed (in order)
    fly: tuple[Sending[_Flight], Receiving[_Flight]] = channel(max(0, res.window - 1))
    s_fly, r_fly = fly

    async def submitter() -> None:
        async with receive, s_fly:
            while (work := await take(receive)) is not None:
                meter.enter()
                f = await _submit(res, attempt, work)
                flying.append(f)
                await give(s_fly, f)

    async def lander() -> None:
        done = 0.0  # perf_counter when the previous bucket landed: a bucket's busy time starts no earlier
        async with r_fly:
            while (f := await take(r_fly)) is not None:
                await _land(res, attempt, f)
                flying.remove(f)
                t = time.perf_counter()
                res.observer.transport_read(name, f.work.pulled, t - f.t0)
                meter.note(1, f.work.pulled, t - max(f.t0, done))
                done = t
                await give(send, f.work)

    try:
        try:
            # a read an earlier attempt abandoned may still land where this one's bytes go: it ends first
            await res.transport.quiesce(res.limits.read_timeout_s)
            async with anyio.create_task_group() as tg:
                tg.start_soon(submitter)
                tg.start_soon(lander)
        except BaseExceptionGroup as group:  # the one error, not a group of it and its echo
            err = first_error(group)
            raise err from err.__cause__
        await send.aclose()  # the end of input, only once every bucket went on: a failure must not look like one
    except (RefitTimeoutError, TransportError):
        # the network failed the reads: the next attempt connects afresh to every source this one read (an
        # endpoint that carried no read when a partition cut it may be dead without a sign once it heals)
        peers = [m.source.agent for m in attempt.publication.manifests]
        res.transport.reconnect(peers + ([attempt.upstream.offer.source.agent] if attempt.upstream else []))
        raise
    finally:  # a failure or a cancellation: what is still landing ends (or is cut short) before staging is freed
        posted = [s for f in flying for s in (f.submitted, f.ahead.posted if f.ahead else None) if s is not None]
        await settle_or_abandon(posted, res.limits.read_timeout_s)
