"""Posting a ``read()``'s prepared READs and waiting for them to end, for ``NixlTransport``.

One worker thread per agent posts that agent's READs one after the other (one thread hop for all of a
bucket's peers: a bucket of a TP-sharded trainer reads from each trainer rank) and checks those in
progress briefly (``LockedAgent.post``); any still pending is polled from the event loop with growing
sleeps (no spinning). A peer whose READ fails does not keep the others from being posted and waited for.
"""

from __future__ import annotations

from collections.abc import Callable

import anyio
import anyio.to_thread

from refitflow.core.errors import TransportError
from refitflow.transports._nixl_state import _Prepared

__all__ = ["transfer"]


async def transfer(batch: list[tuple[_Prepared, str]], count: bool, drop_peer: Callable[[str], None]) -> None:
    """Post every READ of ``batch`` ((prepared, peer) pairs), with its served-bytes notification when
    ``count``, and wait until each has ended; ``drop_peer`` a peer found disconnected, or one with a READ still
    in progress when the wait is cancelled (a read deadline: after a partition heals, its UCX endpoint may be
    dead, and the next read must connect afresh). Raises the first failure, once every READ posted has ended."""
    per_agent: dict[int, list[tuple[_Prepared, str]]] = {}
    for p, peer in batch:
        per_agent.setdefault(id(p.nx), []).append((p, peer))
    failures: list[TransportError] = []

    async def agent_reads(group: list[tuple[_Prepared, str]]) -> None:
        nx = group[0][0].nx
        posts = [(p.handles[2], p.notif if count else b"") for p, _ in group]
        states = await anyio.to_thread.run_sync(nx.post, posts)
        for (p, peer), state in zip(group, states, strict=True):
            try:
                delay = 1e-3
                while state == "PROC":
                    await anyio.sleep(delay)
                    delay = min(delay * 2, 0.002)
                    state = nx.try_state(p.handles[2]) or "PROC"
                if isinstance(state, TransportError):
                    raise state
                if state != "DONE":
                    raise TransportError(f"nixl READ from {peer!r} ended in state {state}")
            except TransportError as exc:
                if isinstance(exc.__cause__, nx.disconnected):
                    drop_peer(peer)
                failures.append(exc)
            except BaseException:  # cancelled (a read deadline) with this READ still in progress
                stuck.update(peer for (_, peer), s in zip(group, states, strict=True) if s == "PROC")
                raise

    stuck: set[str] = set()
    groups = list(per_agent.values())
    try:
        if len(groups) == 1:
            await agent_reads(groups[0])
        else:
            async with anyio.create_task_group() as tg:
                for group in groups:
                    tg.start_soon(agent_reads, group)
    finally:
        for peer in stuck:  # a peer that stopped answering: its connection may be dead after the network heals
            drop_peer(peer)
    if failures:
        raise failures[0]
