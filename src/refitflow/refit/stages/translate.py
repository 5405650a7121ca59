"""Translate: turn staged source bytes into typed boxes and pair each with its destination box.

A staged piece holds its source box row-major; each of its scatters is a sub-box of it that lands
in a box of a destination parameter (a slice of a fused parameter, another TP slice, another rank
of leading dimensions). Layout knowledge is already in the plan's boxes: nothing here is per model.
Only views are made here (``landing.copies_of``); the device work (copies, casts) is apply's.
"""

from __future__ import annotations

import time

from refitflow.core.threads import off_loop
from refitflow.refit.attempt import Attempt, Meter, Resources
from refitflow.refit.handoff import give, take
from refitflow.refit.landing import copies_of
from refitflow.refit.plans import slot
from refitflow.refit.work import Receive, Send

__all__ = ["run"]


async def run(
    res: Resources, attempt: Attempt, receive: Receive, send: Send, meter: Meter
) -> None:
    route, replay = attempt.plan.route, attempt.replay
    async with receive, send:
        while (work := await take(receive)) is not None:
            meter.enter()
            t0 = time.perf_counter()
            staged = work.bucket.staged
            if len(staged) > 64 and slot(work.bucket.index, work.lease, res.destination) not in replay.copies:
                work.copies = await off_loop(copies_of, res, work, route, replay)  # many new views: off the loop
            else:
                work.copies = copies_of(res, work, route, replay) if staged or work.actions is not None else []
            meter.note(1, work.bucket.staging_bytes, time.perf_counter() - t0)
            await give(send, work)
