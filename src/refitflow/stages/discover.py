"""Discover: find the newest complete publication for the receiver's identity, then begin."""

from __future__ import annotations

import time
from collections.abc import Callable

from anyio.abc import ObjectSendStream

from refitflow.core.types import Identity, Publication
from refitflow.stages._context import Discovery, StageContext
from refitflow.stages._filter import check_compile

__all__ = ["run"]


async def run(
    ctx: StageContext,
    registry: Discovery,
    identity: Identity,
    min_version: int,
    timeout: float,
    begin: Callable[[Publication], None],
    send: ObjectSendStream[Publication],
) -> None:
    """Wait (up to ``timeout``) for a complete version ≥ ``min_version``; ``begin`` may refuse it.

    Discovery looks only for the compile targets the receiver accepts, and the compile filter is
    checked before ``begin``, so a refused publication never consumes a version. The wait is not the
    stage's work: it is reported apart (``RefitResult.wait_seconds``).
    """
    async with send:
        ctx.enter("discover")
        t_wait = time.perf_counter()
        targets = ctx.limits.compile_targets
        if targets is None:
            pub = await registry.wait_complete(identity, min_version, timeout)
        else:
            pub = await registry.wait_complete(identity, min_version, timeout, compile_targets=targets)
        t0 = ctx.discovered_at = time.perf_counter()
        ctx.waited_s = t0 - t_wait
        check_compile(pub, ctx.limits)
        ctx.connect_sources(pub)
        begin(pub)
        ctx.publication = pub
        ctx.note("discover", 1, 0, time.perf_counter() - t0)
        await send.send(pub)
