"""How a bucket's pieces land: read (into the destination or staging), translated (staged bytes paired with
destination boxes), written (the pairs copied on the device) — the path of first reads (the pull, translate
and apply stages) and of second ones (verify's repairs: a relay's bad bytes, a skipped piece that changed).

A read lands *directly* (in its parameter's target storage: the live parameter in place, the shadow copy in
shadow mode) or in the bucket's staging lease. For a replayed plan every list here is the very same object as
last time (``plans.Replay``, by ``plans.slot``), so a transport can recognise reads it prepared.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Sequence

import anyio
import anyio.to_thread
import numpy as np

from refitflow.core.dtypes import dtype_from_name
from refitflow.core.errors import RefitTimeoutError, TransportError
from refitflow.core.fanout import RelayOffer
from refitflow.core.threads import off_loop
from refitflow.planner.build import box_index
from refitflow.planner.delta import COPY, PULL
from refitflow.planner.fanout import RELAY
from refitflow.planner.reads import coalesce, piece_read
from refitflow.planner.records import Piece, PlannedRead
from refitflow.planner.routes import Route
from refitflow.refit.attempt import Attempt, Resources
from refitflow.refit.device import Marks
from refitflow.refit.plans import Pair, Replay, slot
from refitflow.refit.transaction import Transaction
from refitflow.refit.work import Work
from refitflow.transports.base import Read, Submitted

# a bucket staging at most this many bytes is copied on the event loop's thread (tens of µs): a worker thread's hop
# costs more (two threads' wake-ups)
INLINE_COPY_BYTES = 1 << 20

__all__ = ["copies_of", "landed", "piece_copies", "read", "read_pieces", "reads_for", "submit_pieces", "write"]


# --- read -------------------------------------------------------------------------------------------------


def reads_for(res: Resources, attempt: Attempt, work: Work, planned: Sequence[PlannedRead]) -> list[Read]:
    """Transport reads of ``planned`` (each into its parameter's target bytes, or the bucket's staging lease)."""
    peers = [m.source.agent for m in attempt.publication.manifests]
    relay: RelayOffer | None = attempt.upstream.offer if attempt.upstream is not None else None
    dest = res.destination
    out = []
    for r in planned:
        n = r.nbytes * r.count
        if r.param is None:
            assert work.lease is not None  # allocate leased what the bucket stages
            dst = work.lease.view[r.landing_offset : r.landing_offset + n]
        else:
            dst = dest.target_bytes(r.param)[r.landing_offset : r.landing_offset + n]
        if r.source == RELAY:
            assert relay is not None  # the plan stage placed relay reads only with an upstream
            peer, region = relay.source.agent, relay.params[r.region].region
        else:
            peer, region = peers[r.source], r.region
        out.append(Read(peer, region, r.src_offset, r.nbytes, dst, r.stride, r.count))
    return out


async def _all_reads(res: Resources, attempt: Attempt, work: Work) -> list[Read]:
    """The bucket's reads; for a cached plan the same list object as last time its slot was the same (a new
    list of many reads is built off the event loop)."""
    key = slot(work.bucket.index, work.lease, res.destination)
    cached = attempt.replay.reads.get(key)
    if cached is None:
        planned = work.bucket.reads
        if len(planned) > 64:
            cached = await off_loop(reads_for, res, attempt, work, planned)
        else:
            cached = reads_for(res, attempt, work, planned)
        attempt.replay.reads[key] = cached
    return cached


async def read(
    res: Resources, attempt: Attempt, work: Work, reads: list[Read], key: Hashable | None, *, count: bool = True
) -> None:
    """Read under ``read_timeout_s``; ``count=False``: reads of a relay (not counted as served, see Transport)."""
    assert res.transport is not None  # a pulling rank has one
    with anyio.move_on_after(res.limits.read_timeout_s) as scope:
        try:
            options = {} if count else {"count": False}  # transports written before ``count`` read counted
            await res.transport.read(reads, key=key, **options)
        except TransportError as exc:
            if exc.version is not None:
                raise
            raise _tagged(exc, attempt) from exc
    if scope.cancelled_caught:
        raise RefitTimeoutError(
            f"reads of bucket {work.bucket.index} took longer than {res.limits.read_timeout_s} s",
            version=attempt.version,
        )


async def _pieces_reads(
    res: Resources, attempt: Attempt, work: Work, pieces: Sequence[int]
) -> tuple[list[Read], Hashable]:
    """The transport reads of some of a bucket's pieces, and their key (the same objects refit after refit)."""
    b = work.bucket
    key = slot(b.index, work.lease, res.destination)
    if len(pieces) == len(b.pieces):  # keyed by slot: a shadow receiver's two storages are two lists of reads
        return await _all_reads(res, attempt, work), (attempt.plan.serial, *key)
    picked = np.asarray(pieces, dtype=np.int64).tobytes()
    cached = attempt.replay.some.get(key)  # the last part of this bucket: a frozen part repeats refit after refit
    if cached is None or cached[0] != picked:
        planned = coalesce([piece_read(b.pieces[k]) for k in pieces])
        cached = attempt.replay.some[key] = (picked, reads_for(res, attempt, work, planned))
    return cached[1], (attempt.plan.serial, "some", *key, hash(picked))


async def read_pieces(res: Resources, attempt: Attempt, work: Work, pieces: Sequence[int]) -> None:
    """Read some of a bucket's pieces from their trainer ranks (all of them, a reroute, a repair, a part)."""
    reads, key = await _pieces_reads(res, attempt, work, pieces)
    await read(res, attempt, work, reads, key)


async def submit_pieces(res: Resources, attempt: Attempt, work: Work, pieces: Sequence[int]) -> Submitted:
    """Start reading some of a bucket's pieces from their trainer ranks and return without waiting for the bytes
    (``landed`` waits)."""
    assert res.transport is not None  # a pulling rank has one
    reads, key = await _pieces_reads(res, attempt, work, pieces)
    try:
        return await res.transport.submit(reads, key=key)
    except TransportError as exc:
        raise _tagged(exc, attempt) from exc


async def landed(res: Resources, attempt: Attempt, work: Work, submitted: Submitted, since: float) -> None:
    """Wait for submitted reads to land, until ``read_timeout_s`` after they were submitted (``since``, a
    ``time.perf_counter()``)."""
    if submitted.landed():  # nothing to wait for (a bucket whose reads ended while the loop handled others)
        return
    with anyio.move_on_after(res.limits.read_timeout_s - (time.perf_counter() - since)) as scope:
        try:
            await submitted.wait()
        except TransportError as exc:
            raise _tagged(exc, attempt) from exc
    if scope.cancelled_caught:
        raise RefitTimeoutError(
            f"reads of bucket {work.bucket.index} took longer than {res.limits.read_timeout_s} s",
            version=attempt.version,
        )


def _tagged(exc: TransportError, attempt: Attempt) -> TransportError:
    """``exc`` with the attempt's version (a transport's error carries none)."""
    return exc if exc.version is not None else TransportError(exc.reason, version=attempt.version, tensor=exc.tensor)


# --- translate ------------------------------------------------------------------------------------------------


def copies_of(res: Resources, work: Work, route: Route, replay: Replay | None) -> list[Pair]:
    """(destination view, staged view) pairs of the bucket; for a replayed plan the same list as last time
    (staging placement is deterministic, shadow targets alternate), except around float8 assembly buffers
    (made anew for every version) and for buckets made outside a plan (``replay`` None: the push stream).

    A delta refit (``work.actions``) copies only the pieces it pulls, and copies the pieces it takes from the
    live storage (``COPY``) there, scatter by scatter."""
    if work.actions is not None:
        assert replay is not None  # only a plan's buckets skip pieces
        per = piece_copies(res, work, route, replay)
        assembled = tuple(p for k, p in enumerate(work.bucket.pieces) if not p.direct and k not in per)  # assemblies
        out = [c for k, a in enumerate(work.actions.tolist()) if a == PULL for c in per.get(k, ())]
        return out + _staged(res, work, route, assembled) + _from_live(res, work, work.actions)
    if work.bucket.derived or replay is None:
        return _staged(res, work, route)
    key = slot(work.bucket.index, work.lease, res.destination)
    cached = replay.copies.get(key)
    if cached is None:
        cached = replay.copies[key] = _staged(res, work, route)
    return cached


def piece_copies(res: Resources, work: Work, route: Route, replay: Replay) -> dict[int, list[Pair]]:
    """The copies of each staged piece (by its index in the bucket) but those into assemblies (made anew for
    every version; such pieces are never skipped or relayed), cached like ``copies_of``."""
    key = slot(work.bucket.index, work.lease, res.destination)
    cached = replay.piece_copies.get(key)
    if cached is None:
        assembled = route.assembled
        cached = replay.piece_copies[key] = {
            k: _staged(res, work, route, (p,))
            for k, p in enumerate(work.bucket.pieces)
            if not p.direct and not any(s.param in assembled for s in p.scatters)
        }
    return cached


def _from_live(res: Resources, work: Work, actions: np.ndarray) -> list[Pair]:
    """Copies of the ``COPY`` pieces' boxes from the live storage into the target (shadow delta refits)."""
    out = []
    dest = res.destination
    for k in np.flatnonzero(actions == COPY).tolist():
        for s in work.bucket.pieces[k].scatters:
            at = box_index(s.dbox)
            out.append((dest.target(s.param)[at], dest.live(s.param)[at]))
    return out


def _staged(res: Resources, work: Work, route: Route, pieces: tuple[Piece, ...] | None = None) -> list[Pair]:
    """The pairs of staged pieces (default: all the bucket's): each scatter's destination box and staged box."""
    out = []
    dest = res.destination
    with res.devices.use(work.bucket.devices):  # assembly buffers belong to the refit streams
        for p in work.bucket.staged if pieces is None else pieces:
            assert work.lease is not None  # a staged piece has staging
            raw = work.lease.view[p.landing_offset : p.landing_offset + p.nbytes]
            dtype = dtype_from_name(p.src_dtype)
            if raw.storage_offset() % dtype.itemsize:  # packed after an odd-sized entry (a stream): realign it
                raw = raw.clone()
            staged = raw.view(dtype).view(p.shape)
            for s in p.scatters:
                rel = tuple((a - o, b - o) for (a, b), (o, _) in zip(s.sub, p.box, strict=True))
                if s.param in route.assembled:
                    whole = dest.assembly(s.param, route.aux.get(s.param))
                else:
                    whole = dest.target(s.param)
                out.append((whole[box_index(s.dbox)], staged[box_index(rel)]))  # apply reshapes, on the device
    return out


# --- write ----------------------------------------------------------------------------------------------------


def _copy_all(res: Resources, work: Work) -> Marks:
    """Issue the bucket's copies on its refit streams (in the worker thread) and mark them."""
    devices = res.devices
    with devices.use(work.bucket.devices):
        for dst, src in work.copies:
            dst.copy_(src if src.shape == dst.shape else src.reshape(dst.shape))
        return devices.record(work.bucket.devices)


async def write(res: Resources, txn: Transaction, work: Work) -> None:
    """Write one bucket's copies into their destinations (marking the transaction written first)."""
    if work.copies:
        txn.wrote = True
        if work.bucket.staging_bytes <= INLINE_COPY_BYTES:  # a hop would cost more than the copies
            work.marks = _copy_all(res, work)
        else:
            work.marks = await anyio.to_thread.run_sync(_copy_all, res, work)
