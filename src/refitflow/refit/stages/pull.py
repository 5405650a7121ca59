"""Pull: issue a bucket's reads through the transport, straight into parameters or into staging.

Which pieces are read, and from where: every piece from its trainer rank, except pieces a delta refit
leaves (``Work.actions``, ``planner/delta.py``) and pieces the attempt's upstream relay holds
(``fanout.reading``: read once the relay has verified them; what it cannot deliver is read from the trainer).
The reads themselves go the landing path (``refit/landing.py``), as verify's second reads do.
"""

from __future__ import annotations

import time

import numpy as np
from anyio.abc import ObjectReceiveStream, ObjectSendStream

from refitflow.planner.delta import PULL
from refitflow.refit.attempt import Attempt, Meter, Resources
from refitflow.refit.fanout.reading import owed_by_upstream, take
from refitflow.refit.landing import read_pieces
from refitflow.refit.work import Work

__all__ = ["run"]


async def _pull(res: Resources, attempt: Attempt, work: Work) -> None:
    b = work.bucket
    pull = list(range(len(b.pieces))) if work.actions is None else np.flatnonzero(work.actions == PULL).tolist()
    owed = owed_by_upstream(attempt, work, pull)
    mine = [k for k in pull if k not in owed]
    if mine:
        await read_pieces(res, attempt, work, mine)
    if owed:
        await take(res, attempt, work, owed)
    work.pulled += int(b.checks.piece_bytes[pull].sum()) if len(pull) < len(b.pieces) else b.nbytes


def _writes_directly(work: Work) -> bool:
    """Whether the bucket's reads land straight in destination tensors."""
    if work.actions is None:
        return bool(work.bucket.direct_bytes)
    return any(p.direct and a == PULL for p, a in zip(work.bucket.pieces, work.actions.tolist(), strict=True))


async def run(
    res: Resources, attempt: Attempt, receive: ObjectReceiveStream[Work], send: ObjectSendStream[Work], meter: Meter
) -> None:
    assert res.transport is not None  # a pulling rank has one
    async with receive, send:
        async for work in receive:
            meter.enter()
            t0 = time.perf_counter()
            if _writes_directly(work):
                attempt.txn.wrote = True
            await _pull(res, attempt, work)
            res.observer.transport_read(res.transport.name, work.pulled, time.perf_counter() - t0)
            meter.note(1, work.pulled, time.perf_counter() - t0)
            await send.send(work)
