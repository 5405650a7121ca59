"""The engine vote for engines with a torch.distributed group: a write-once register in the group's c10d store.

A collective cannot carry an atomic commitment: an ``all_gather`` abandoned at one rank's deadline
completes later on a peer that was stalled, which then holds every ballot and decides alone. So
this channel uses no collective. Every torch.distributed group already has a key-value store (the
c10d store its ranks met through, usually a ``TCPStore``), whose ``compare_set`` is atomic. Per
attempt ``a``:

- each rank writes its ballot once at ``{name}/{a}/b/{rank}`` (``compare_set`` from empty);
- any rank that reads every ballot, or a ballot that is not ready beside one that began, writes the
  rule's verdict at ``{name}/{a}/d`` — only if nothing is written there (``compare_set``); a rank
  whose deadline passed writes ABORT the same way (never a verdict from ballots after it);
- every rank's decision is whatever the register holds: the first write wins, for everyone.

A rank that learned the verdict says so (``{name}/{a}/k/{rank}``) and waits up to ``linger_s`` for
every peer to say it too: the store usually lives in one rank's process, and a rank that returns and
exits at once would otherwise take the register away from a peer still polling it. A rank is in
doubt only while it cannot reach the store; ``resolve`` reads the register again (and,
the attempt being over for this rank, writes ABORT if nothing is written). Verdicts stay in the
store (about 60 bytes per attempt): deleting one would let a stalled rank write a second one.
Store calls run in a worker thread, one at a time, each under the caller's deadline (a call to a
stopped store is abandoned, and the next waits for it).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import anyio
import anyio.to_thread

from refitflow.core.errors import ConfigError
from refitflow.core.wire import decode, encode
from refitflow.engine.vote import AttemptIds, Ballot, Decision, Verdict, decide, why

__all__ = ["GlooVote"]

log = logging.getLogger(__name__)


class GlooVote(AttemptIds):
    """``VoteChannel`` over the c10d store of ``group`` (default: the world group), or over ``store``."""

    def __init__(self, group: Any = None, *, store: Any = None, name: str = "refitflow-vote",
                 poll_s: float = 0.05, linger_s: float = 2.0) -> None:  # fmt: skip
        import torch.distributed as dist

        if group is None:
            group = dist.group.WORLD
        if group is None:
            raise ConfigError("GlooVote needs an initialised torch.distributed group")
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.store = store if store is not None else group.get_group_store()
        self.name = name
        self.poll_s = poll_s
        self.linger_s = linger_s
        self._calls = anyio.CapacityLimiter(1)  # at most one store call (and one abandoned thread) at a time

    async def vote(self, ballot: Ballot, timeout: float) -> Verdict:
        attempt = self._begin_attempt()
        deadline = time.monotonic() + timeout
        try:
            with anyio.fail_after(max(timeout, 0.0)):
                await self._call(self.store.compare_set, self._ballot_key(attempt, self.rank), "",
                                 encode([ballot.ready, ballot.began, ballot.version]))  # fmt: skip
                while True:
                    written = await self._read(attempt)
                    if written is None:
                        determined = await self._determined(attempt)
                        if determined is not None and time.monotonic() < deadline:
                            written = await self._write(determined)
                    if written is not None:
                        await self._settle(attempt)
                        return written
                    await anyio.sleep(self.poll_s)
        except (TimeoutError, RuntimeError) as exc:  # past the deadline, or the store failed (c10d errors)
            if not isinstance(exc, TimeoutError):
                log.warning("engine vote: store failed during attempt %d: %s", attempt, exc)
        verdict = await self.resolve(attempt, timeout=max(1.0, min(timeout, 5.0)))
        if verdict.decision is not Decision.IN_DOUBT:  # learned past the deadline: linger for the peers too
            with anyio.move_on_after(self.linger_s + 1.0):
                try:
                    await self._settle(attempt)
                except RuntimeError:
                    pass  # the store went away after answering: the peers learn it elsewhere or are in doubt
        return verdict

    async def resolve(self, attempt: int, timeout: float) -> Verdict:
        """The register's verdict; this rank's deadline is past, so it writes ABORT if nothing is written."""
        try:
            with anyio.fail_after(timeout):
                return await self._write(Verdict(attempt, Decision.ABORT, None, f"rank {self.rank}: deadline passed"))
        except (TimeoutError, RuntimeError) as exc:  # the store is stopped, gone or refusing
            log.warning("engine vote: store unreachable for attempt %d: %s", attempt, exc)
        return Verdict(attempt, Decision.IN_DOUBT, None, "the group's store did not answer")

    async def _settle(self, attempt: int) -> None:
        """Say this rank learned the verdict; wait (at most ``linger_s``) until every rank has said so."""
        await self._call(self.store.compare_set, f"{self.name}/{attempt}/k/{self.rank}", "", b"1")
        keys = [f"{self.name}/{attempt}/k/{r}" for r in range(self.size)]
        with anyio.move_on_after(self.linger_s):
            while not await self._call(self.store.check, keys):  # noqa: ASYNC110 (a store in another process)
                await anyio.sleep(self.poll_s)

    async def _determined(self, attempt: int) -> Verdict | None:
        keys = [self._ballot_key(attempt, r) for r in range(self.size)]
        present: list[Ballot | None] = []
        for key in keys:
            raw = await self._call(_get_if_set, self.store, key)
            present.append(None if raw is None else _ballot(raw))
        if None not in present:
            d = decide(present)
            version = present[0].version if d is Decision.COMMIT and present[0] is not None else None
            return Verdict(attempt, d, version, why(present))
        known = [b for b in present if b is not None]
        if any(not b.ready for b in known) and any(b.began for b in known):
            return Verdict(attempt, Decision.ABORT, None, why(present, early=True))
        return None

    async def _read(self, attempt: int) -> Verdict | None:
        raw = await self._call(_get_if_set, self.store, self._verdict_key(attempt))
        return None if raw is None else _verdict(attempt, raw)

    async def _write(self, verdict: Verdict) -> Verdict:
        """Write ``verdict`` unless one is written; return the one that is."""
        raw = encode([verdict.decision.value, verdict.version, verdict.reason[:500]])
        won = await self._call(self.store.compare_set, self._verdict_key(verdict.attempt), "", raw)
        return _verdict(verdict.attempt, won)

    async def _call(self, fn: Any, *args: Any) -> Any:
        return await anyio.to_thread.run_sync(fn, *args, abandon_on_cancel=True, limiter=self._calls)

    def _ballot_key(self, attempt: int, rank: int) -> str:
        return f"{self.name}/{attempt}/b/{rank}"

    def _verdict_key(self, attempt: int) -> str:
        return f"{self.name}/{attempt}/d"


def _get_if_set(store: Any, key: str) -> bytes | None:
    return store.get(key) if store.check([key]) else None


def _ballot(raw: bytes) -> Ballot:
    ready, began, version = decode(raw)
    return Ballot(bool(ready), bool(began), int(version))


def _verdict(attempt: int, raw: bytes) -> Verdict:
    decision, version, reason = decode(raw)
    return Verdict(attempt, Decision(decision), version, reason)
