"""Reading from an upstream relay: the pieces it holds, once its status says they are verified.

A relay's piece is read only once the relay's status says every tensor it lies in is verified for this
version. The status is read into the probe only when the last one read does not show that yet: a tensor's
flag, once it names this version, stays so until the relay begins another version — so a reader behind its
relay reads bucket after bucket with no status read between them, not one (or two) per bucket; a reader that
waits for its relay paces its reads by how long its waits took so far (``poll_sleeps``: a chain of 8 on 2 shared
cores made 35 % fewer). Under ``verify="strict"`` pull's submitter waits, bucket by bucket, until the status
shows a bucket's relayed pieces verified and submits their reads with the bucket's trainer reads
(``submit_ahead``): many buckets in flight, a reader close behind its relay included — instead of reading them
one bucket at a time as each lands
(``take_relayed``: two thread round trips a bucket, which a chain of readers on shared cores paid hop after
hop; it remains for other verify modes). If the relay failed, made no progress for ``relay_wait_s``, or moved on
(its status no longer names this version), the pieces still owed are read from the trainer (*rerouted*) and
the relay is not read again in this attempt.

A relay that began another version while a reader took its bytes (in place, its storage changes) sends bytes
that are not this version's: under ``verify="strict"`` (a relay serves only such readers' bytes verified, and
every reader's relayed bytes are verified like any read) the digests catch them, the relay fails
(``Upstream.fail``) and its pieces are read again from the trainer within their bucket. A reader that verifies
only what it pulled whole (``verify="pulled"``) reads the status again after each read instead, and reroutes
if the relay left the version meanwhile.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Iterator
from dataclasses import dataclass

import anyio
import torch

from refitflow.core.errors import RefitTimeoutError, TransportError
from refitflow.planner.fanout import RelayPiece
from refitflow.planner.reads import coalesce
from refitflow.refit.attempt import Attempt, Resources
from refitflow.refit.fanout.relaying import Upstream
from refitflow.refit.landing import landed, read, read_pieces, reads_for
from refitflow.refit.plans import slot
from refitflow.refit.work import Work
from refitflow.transports.base import Read, Submitted, as_bytes, settle_or_abandon

__all__ = ["Ahead", "averaged", "land_ahead", "owed_by_upstream", "poll_sleeps", "status_read", "submit_ahead",
           "take_relayed"]  # fmt: skip

MIN_SLEEP_S, MAX_SLEEP_S = 2e-4, 5e-3  # a waiting reader's sleeps between its relay's status reads


def owed_by_upstream(attempt: Attempt, work: Work, pull: list[int]) -> dict[int, RelayPiece]:
    """Of the pieces to ``pull``, those the attempt's upstream relay holds (none once it failed)."""
    up = attempt.upstream
    if up is None or up.failed is not None:
        return {}
    held = up.geometry.buckets[work.bucket.index]
    return {k: held[k] for k in pull if k in held}


@dataclass(eq=False, slots=True)
class Ahead:
    """A bucket's relayed pieces submitted with its trainer reads (``submit_ahead``), in flight."""

    posted: Submitted
    ready: list[RelayPiece]
    since: float  # perf_counter when submitted: its read deadline runs from there


def _ready(attempt: Attempt, up: Upstream, owed: dict[int, RelayPiece]) -> list[RelayPiece]:
    """The ``owed`` pieces the relay's last status read shows verified for this version."""
    flags, v = up.probe.numpy()[1:], attempt.version
    return [rp for rp in owed.values() if (flags[rp.params] == v).all()]


async def submit_ahead(res: Resources, attempt: Attempt, work: Work, owed: dict[int, RelayPiece]) -> Ahead | None:
    """Submit the reads of a bucket's ``owed`` pieces beside its trainer reads — in the pull's window, not one
    bucket at a time as it lands — once the relay's status shows every one of them verified (read again, with
    backoff, while it does not: the submitter waits for the relay, the buckets already submitted land meanwhile),
    when a relay's bytes are verified like any read (``verify="strict"``). None when it cannot (another verify
    mode: ``take_relayed`` reads them as the bucket lands; or the relay failed, left the version or made no
    progress within ``relay_wait_s``: failed, and ``take_relayed`` reads them from the trainer)."""
    up = attempt.upstream
    if not owed or up is None or up.failed is not None or res.limits.verify != "strict":
        return None
    ready = await _verified(res, attempt, work, up, owed, every=True)
    if ready is None:
        return None
    assert res.transport is not None  # a pulling rank has one
    reads, key = _reads(res, attempt, work, ready)
    since = time.perf_counter()
    try:
        posted = await res.transport.submit(reads, key=key, count=False)
    except TransportError as exc:
        up.fail(f"{type(exc).__name__}: {exc}")
        return None
    return Ahead(posted, ready, since)


async def _verified(res: Resources, attempt: Attempt, work: Work, up: Upstream, owed: dict[int, RelayPiece],
                    *, every: bool) -> list[RelayPiece] | None:  # fmt: skip
    """The ``owed`` pieces the relay's status shows verified — all of them (``every``), else at least one — from
    the last status read, else reading it again (paced: ``poll_sleeps``); None, the relay failed, if it left the
    version, a status read failed or no more pieces became verified for ``relay_wait_s``."""
    need = len(owed) if every else 1
    ready = _ready(attempt, up, owed)
    if len(ready) >= need:
        return ready
    since = anyio.current_time()
    deadline, seen, sleeps = since + res.limits.relay_wait_s, len(ready), poll_sleeps(up.pace)
    if up.pace:  # the relay verifies about one bucket per pace: a read now would show what the last one did
        await anyio.sleep(next(sleeps))
    while len(ready) < need:
        try:
            if not await _status(res, attempt, work, up):
                up.fail(f"it no longer holds version {attempt.version}")
                return None
        except (TransportError, RefitTimeoutError) as exc:
            up.fail(f"{type(exc).__name__}: {exc}")
            return None
        ready = _ready(attempt, up, owed)
        if len(ready) >= need:
            break
        if len(ready) > seen:  # progress: the relay is alive
            deadline, seen = anyio.current_time() + res.limits.relay_wait_s, len(ready)
        elif anyio.current_time() >= deadline:
            up.fail(f"no progress within relay_wait_s={res.limits.relay_wait_s} s")
            return None
        await anyio.sleep(next(sleeps))
    up.pace = averaged(up.pace, anyio.current_time() - since)
    return ready


def averaged(pace: float, waited: float) -> float:
    """A reader's pace for its relay after a wait of ``waited`` s: the mean of the last pace and the wait (the
    wait itself while none is known)."""
    return waited if not pace else (pace + waited) / 2


def poll_sleeps(pace: float) -> Iterator[float]:
    """The sleeps between status reads of a reader that waits for its relay: 0.2 ms doubling to 5 ms while the
    relay's pace is unknown; else three quarters of it first (before any read: the relay verifies a bucket about
    once a ``pace`` while the reader keeps up with it), then an eighth of it doubling (at least 0.2 ms, at most
    5 ms) — a reader close behind its relay reads its status about twice a bucket, not five times."""
    if pace:
        yield min(max(0.75 * pace, MIN_SLEEP_S), MAX_SLEEP_S)
    delay = min(max(pace / 8, MIN_SLEEP_S), MAX_SLEEP_S)
    while True:
        yield delay
        delay = min(delay * 2, MAX_SLEEP_S)


async def land_ahead(res: Resources, attempt: Attempt, work: Work, ahead: Ahead, owed: dict[int, RelayPiece]) -> None:
    """Wait for relayed reads ``submit_ahead`` submitted; what they could not deliver is left in ``owed`` for
    ``take_relayed`` (which reads it from the trainer: the relay is failed)."""
    up = attempt.upstream
    assert up is not None  # ahead of a relay
    try:
        await landed(res, attempt, work, ahead.posted, ahead.since)
    except (TransportError, RefitTimeoutError) as exc:
        await settle_or_abandon([ahead.posted], res.limits.read_timeout_s)
        up.fail(f"{type(exc).__name__}: {exc}")
        return
    _took(work, owed, ahead.ready)


def _took(work: Work, owed: dict[int, RelayPiece], ready: list[RelayPiece]) -> None:
    """``ready`` pieces landed from the relay: no longer owed."""
    for rp in ready:
        del owed[rp.piece]
        work.relayed.append(rp.piece)
    work.relay_bytes += int(work.bucket.checks.piece_bytes[[rp.piece for rp in ready]].sum())


def _reads(res: Resources, attempt: Attempt, work: Work, ready: list[RelayPiece]) -> tuple[list[Read], Hashable]:
    """The reads of ``ready`` pieces from the relay, and their read key. The reads are the very list object as last
    version while the relay is the same one (agent, address, regions, layout: checked once an attempt), so the
    transport replays its description and preparation of them instead of describing them again for every relayed
    bucket of every version. The key is the same refit after refit while the plan is (its group, so forgotten with
    it); the transport compares the descriptors as they are, since the relay may be another (it prepares anew for
    another peer or regions)."""
    up, replay = attempt.upstream, attempt.replay
    assert up is not None  # relayed pieces come from it
    if replay.relay_upstream is not up:
        offer = up.offer
        relay = (offer.source.agent, offer.source.metadata, offer.layout, tuple(p.region for p in offer.params))
        if replay.relay != relay:
            replay.relayed.clear()
            replay.relay = relay
        replay.relay_upstream = up
    where, pieces = slot(work.bucket.index, work.lease, res.destination), tuple(rp.piece for rp in ready)
    reads = replay.relayed.get((where, pieces))
    if reads is None:
        planned = coalesce([r for rp in ready for r in rp.reads])
        reads = replay.relayed[where, pieces] = reads_for(res, attempt, work, planned)
    return reads, (attempt.plan.serial, "relayed", *where, pieces)


def status_read(agent: str, region: int, probe: torch.Tensor) -> list[Read]:
    """The one read of a relay's status words (region ``region`` of ``agent``) into ``probe``."""
    return [Read(agent, region, 0, probe.numel() * 8, as_bytes(probe))]


async def _status(res: Resources, attempt: Attempt, work: Work, up: Upstream) -> bool:
    """Read the relay's status into its probe: whether its storage still holds or receives this version."""
    if not up.status_reads:  # one list object, read again and again: a transport replays what it prepared
        up.status_reads = status_read(up.offer.source.agent, up.offer.status, up.probe)
    key = ("relay-status", up.offer.source.agent, up.offer.status)
    await read(res, attempt, work, up.status_reads, key, count=False)
    return int(up.probe[0]) == attempt.version


async def take_relayed(res: Resources, attempt: Attempt, work: Work, owed: dict[int, RelayPiece]) -> None:
    """Read ``owed`` pieces from the upstream relay as it verifies them; reroute what it cannot deliver."""
    up = attempt.upstream
    assert up is not None  # owed pieces come from it
    piece_bytes = work.bucket.checks.piece_bytes
    strict = res.limits.verify == "strict"
    while owed and up.failed is None:
        ready = await _verified(res, attempt, work, up, owed, every=False)
        if ready is None:
            break
        assert res.transport is not None  # a pulling rank has one
        try:
            reads, key = _reads(res, attempt, work, ready)
            posted = await res.transport.submit(reads, key=key, count=False)
            try:
                await landed(res, attempt, work, posted, time.perf_counter())
            except BaseException:  # a read that failed or ran late ends before the trainer's bytes land there
                await settle_or_abandon([posted], res.limits.read_timeout_s)
                raise
            if not strict and not await _status(res, attempt, work, up):  # it moved on while we read
                up.fail(f"it left version {attempt.version} while being read")
                break
        except (TransportError, RefitTimeoutError) as exc:
            up.fail(f"{type(exc).__name__}: {exc}")
            break
        _took(work, owed, ready)
    if owed:
        assert res.transport is not None  # a pulling rank has one
        await res.transport.quiesce(res.limits.read_timeout_s)  # a relay's abandoned read lands there no more
        await read_pieces(res, attempt, work, sorted(owed))
        work.rerouted += int(piece_bytes[sorted(owed)].sum())
