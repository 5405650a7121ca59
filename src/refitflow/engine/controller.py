"""The controller: an RL loop's view of every engine's refit, as one async call.

``await Controller({"engine-a": [addr0, addr1], ...}).refit(v)`` sends every rank (an
``EngineAgent``) the same refit command, waits for every reply under one deadline, and returns
one ``EngineResult`` per engine. An engine succeeded only if every one of its ranks answered that
it committed ``v``; a rank that does not answer before the deadline (dead, hung, unreachable)
counts as failed for its engine.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import zmq
import zmq.asyncio

from refitflow.core.errors import ConfigError
from refitflow.core.wire import decode, encode
from refitflow.engine.readiness import EngineState, rank_summary
from refitflow.registry.security import ClientSecurity

__all__ = ["Controller", "EngineResult", "RankReport"]


@dataclass(frozen=True, kw_only=True)
class RankReport:
    committed: bool
    decision: str | None  # the engine vote's decision as this rank saw it
    version: int | None
    committed_version: int | None  # what the rank serves now
    fence: str | None
    error: str | None  # the rank's own failure, or why its answer is missing
    pulled_bytes: int = 0  # what this refit read, in all ...
    relay_bytes: int = 0  # ... and of that from peers (relays): the rest came from the trainer


@dataclass(frozen=True, kw_only=True)
class EngineResult:
    engine: str
    committed: bool  # every rank committed, the same version
    version: int | None  # that version (None unless committed)
    ranks: tuple[RankReport, ...]

    @property
    def failed_ranks(self) -> list[int]:
        return [i for i, r in enumerate(self.ranks) if not r.committed]


class Controller:
    """The RL loop's handle on every inference engine: refit them all to a version with one call.

    ::

        controller = rf.Controller({"engine-a": ["tcp://10.0.0.7:7300", "tcp://10.0.0.8:7300"]})
        results = await controller.refit(version, timeout=60)      # {engine: rf.EngineResult}
        assert all(r.committed for r in results.values())

    Arguments: ``engines`` maps each engine's name to the addresses of its ranks' ``rf.EngineAgent``s
    (each rank runs ``EngineAgent(EngineMember(receiver, vote), address).serve()``); ``slack_s`` (10) is
    how long past a refit's ``timeout`` the controller waits for answers (the vote, the commit, the
    reply). A rank that does not answer by then fails its engine. ``security`` (None): CURVE on every
    agent socket — the controller's ``rf.ClientSecurity`` from the deployment's key set (``refitflow
    keys``), the agents holding the matching ``rf.ServerSecurity``. ``status()`` asks every rank for its
    receiver status; ``stop_agents()`` ends the agents' loops.

    **A fleet that changes.** ``await join(name, ranks)`` adds an engine (new, restarted, or replaced on other
    addresses: the name's old addresses are forgotten) and refits it at once to the fleet's version — the
    newest any engine committed through this controller — reading from the peers that hold it where they
    relay (``serve_replicas``), so the trainer serves only what no peer offers; ``remove(name)`` forgets one.
    ``states()`` says per engine whether a router may send it requests (``rf.EngineState``: current,
    catching up, behind, fenced, gone). No other engine is touched by a join or a removal.
    """

    def __init__(self, engines: Mapping[str, Sequence[str]], *, slack_s: float = 10.0,
                 security: ClientSecurity | None = None) -> None:  # fmt: skip
        if not engines or any(not ranks for ranks in engines.values()):
            raise ConfigError("a controller needs at least one engine, each with at least one rank address")
        self.engines = {name: list(ranks) for name, ranks in engines.items()}
        self.slack_s = slack_s  # beyond the refit timeout: the vote, the commit, the reply
        self.security = security
        # command ids double as vote attempt ids: they increase across controller restarts too
        self._ids = itertools.count(time.time_ns() // 1000)
        self._refitting = anyio.Lock()
        self.version: int | None = None  # the fleet's version: the newest any engine committed through us
        self._joining: set[str] = set()  # joined, no version committed since

    async def refit(self, version: int, *, timeout: float = 60.0,
                    engines: Sequence[str] | None = None) -> dict[str, EngineResult]:  # fmt: skip
        """Refit every engine (or those named in ``engines``) to the newest version ≥ ``version`` (waiting up
        to ``timeout`` s for one).

        An engine's result is committed only when every rank committed, and all the same version.

        Refits of one controller run one at a time (a later call waits for the earlier one, then finds
        its version committed): a rank runs one command at a time and answers another "busy", so two
        commands sent at once could reach an engine's ranks in opposite orders — each rank in a
        different attempt, neither vote complete, the version committed nowhere.
        """
        async with self._refitting:
            command = {"op": "refit", "id": next(self._ids), "version": version, "timeout": timeout}
            replies = await self._ask_all(command, timeout + self.slack_s, engines)
        results = {}
        for name, ranks in replies.items():
            reports = tuple(_report(r) for r in ranks)
            versions = {r.version for r in reports}
            ok = all(r.committed for r in reports) and len(versions) == 1
            agreed = versions.pop() if ok else None
            ok = ok and agreed is not None and agreed >= version
            results[name] = EngineResult(engine=name, committed=ok, version=agreed if ok else None, ranks=reports)
            if ok and agreed is not None:
                self._joining.discard(name)
                self.version = max(self.version or 0, agreed)
        return results

    async def join(self, name: str, ranks: Sequence[str], *, timeout: float = 60.0) -> EngineResult:
        """Add engine ``name`` (its ranks' agent addresses; a name already known is replaced) and refit it to
        the fleet's version at once; its result. Until that commits, ``states()`` says it is catching up."""
        if not ranks:
            raise ConfigError(f"engine {name!r} needs at least one rank address")
        self.engines[name] = list(ranks)
        self._joining.add(name)
        return (await self.refit(self.version or 0, timeout=timeout, engines=[name]))[name]

    def remove(self, name: str) -> None:
        """Forget engine ``name`` (gone for good, or about to rejoin on other addresses)."""
        self.engines.pop(name, None)
        self._joining.discard(name)

    async def states(self, *, timeout: float = 5.0) -> dict[str, EngineState]:
        """Every engine's state as a router sees it (``rf.EngineState``: only ``current`` takes traffic)."""
        ranks = await self.status(timeout=timeout)
        return {name: rank_summary(name, rs, target=self.version, joining=name in self._joining)
                for name, rs in ranks.items()}  # fmt: skip

    async def status(self, *, timeout: float = 5.0) -> dict[str, list[dict[str, Any] | None]]:
        """Every rank's receiver status (``None`` for a rank that did not answer in time)."""
        replies = await self._ask_all({"op": "status", "id": next(self._ids)}, timeout)
        return {n: [r["result"] if r and r.get("ok") else None for r in rs] for n, rs in replies.items()}

    async def stop_agents(self, *, timeout: float = 5.0) -> None:
        """Ask every agent to stop serving commands (the ranks keep serving their model)."""
        await self._ask_all({"op": "stop", "id": next(self._ids)}, timeout)

    async def _ask_all(self, command: dict[str, Any], deadline: float,
                       engines: Sequence[str] | None = None) -> dict[str, list[dict[str, Any] | None]]:  # fmt: skip
        unknown = sorted(set(engines or ()) - set(self.engines))
        if unknown:
            raise ConfigError(f"unknown engines {unknown}: join them first")
        asked = {n: self.engines[n] for n in (self.engines if engines is None else engines)}
        replies: dict[str, list[dict[str, Any] | None]] = {n: [None] * len(rs) for n, rs in asked.items()}
        context = zmq.asyncio.Context()
        try:
            with anyio.move_on_after(deadline):
                async with anyio.create_task_group() as tg:
                    for name, ranks in asked.items():
                        for i, address in enumerate(ranks):
                            tg.start_soon(_ask, context, self.security, address, command, replies[name], i)
        finally:
            context.destroy(linger=0)
        return replies


async def _ask(context: zmq.asyncio.Context, security: ClientSecurity | None, address: str, command: dict[str, Any],
               into: list[Any], i: int) -> None:  # fmt: skip
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if security is not None:
        security.apply(sock)
    try:
        sock.connect(address)
        await sock.send(encode(command))
        while True:  # a reply to an earlier command (one we gave up on) is not this one's
            reply = decode(await sock.recv())
            if isinstance(reply, dict) and reply.get("id") == command["id"]:
                into[i] = reply
                return
    finally:
        sock.close(linger=0)


def _report(reply: dict[str, Any] | None) -> RankReport:
    if reply is None:
        return RankReport(committed=False, decision=None, version=None, committed_version=None, fence=None,
                          error="no answer before the deadline (dead, hung or unreachable)")  # fmt: skip
    if not reply.get("ok"):
        return RankReport(committed=False, decision=None, version=None, committed_version=None, fence=None,
                          error=str(reply.get("result")))  # fmt: skip
    r = reply["result"]
    return RankReport(
        committed=bool(r["committed"]), decision=r["decision"], version=r["version"],
        committed_version=r["committed_version"], fence=r["fence"], error=r["error"],
        pulled_bytes=int(r.get("pulled_bytes") or 0), relay_bytes=int(r.get("relay_bytes") or 0),
    )  # fmt: skip
