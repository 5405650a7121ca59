"""What both fleet drivers (``VllmFleet``, ``SglangFleet``) keep about a fleet that changes: its servers by
name, the fleet's version (the newest a server committed through the driver), and every server's state as a
router sees it (``rf.EngineState``, from each server's readiness route ``GET /refitflow/ready``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import anyio

from refitflow.core.errors import RefitError
from refitflow.engine.controller import EngineResult
from refitflow.engine.readiness import EngineState
from refitflow.integrations.hosting.http import each_server, named_servers, ready_answer, ready_state

__all__ = ["Membership", "read_starts", "spread"]

Done = Callable[[EngineState, dict[str, Any]], bool]  # a server's state (by its own account), its route's body


def read_starts(names: Sequence[str], options: Mapping[str, Any]) -> dict[str, float]:
    """Where each server starts reading its slices (``rf.ReceiverConfig.read_start``): server i of n, by name,
    at i / n — engines that read the trainer only then read from different trainer ranks at once — unless
    ``options`` (the servers' receiver options) set one or relay (relays read in one order): then none. The
    first server's 0 is left out: its init info stays the caller's (a changed init reopens an SGLang rank's
    session), and a fleet of one is as it was."""
    if not spread(options):
        return {}
    ordered = sorted(names)
    return {name: i / len(ordered) for i, name in enumerate(ordered) if i}


def spread(options: Mapping[str, Any]) -> bool:
    """Whether servers of these receiver options are given a ``read_start`` by the driver: not when they relay
    (relays read in one order) or the caller set one."""
    return "read_start" not in options and not options.get("serve_replicas")


class Membership:
    """The servers of a fleet driver and how current each is. ``membership`` (an ``anyio.Lock``): a driver's
    refits and adds run one at a time, so no refit of the fleet completes while a server is being brought to
    the fleet's version outside it."""

    def __init__(self, servers: Mapping[str, str] | Sequence[str], request_timeout_s: float) -> None:
        self.membership = anyio.Lock()
        self.servers = named_servers(servers)
        self.request_timeout_s = request_timeout_s
        self.paused: set[str] = set()  # servers left paused (fenced) by a failed in-place update
        self.version: int | None = None  # the fleet's: the newest version a server committed through this driver

    def note(self, results: Mapping[str, EngineResult]) -> dict[str, EngineResult]:
        """Raise the fleet's version to the newest any of ``results`` committed; ``results``."""
        committed = [r.version for r in results.values() if r.committed and r.version is not None]
        if committed:
            self.version = max(committed + ([] if self.version is None else [self.version]))
        return dict(results)

    def remove(self, name: str) -> None:
        """Forget server ``name`` (gone, or about to be added again at another address)."""
        self.servers.pop(name, None)
        self.paused.discard(name)

    async def states(self, *, timeout_s: float = 5.0) -> dict[str, EngineState]:
        """Every server's ``rf.EngineState`` from its readiness route (only ``current`` takes traffic; short of
        the fleet's version a server is behind; no answer: gone)."""
        return await each_server(self.servers, lambda n, u: ready_state(n, u, target=self.version, timeout_s=timeout_s))

    async def wait_until(self, name: str, url: str, timeout_s: float, done: Done) -> EngineState:
        """Poll server ``name``'s readiness route until ``done(state, body)`` (its state by its own account, and
        the route's body) or it is fenced; ``RefitError`` with its state after ``timeout_s``."""
        state: EngineState | None = None
        with anyio.move_on_after(timeout_s):
            while True:
                state, body = await ready_answer(name, url, target=None, timeout_s=self.request_timeout_s)
                if done(state, body) or state.state == "fenced":
                    break
                await anyio.sleep(0.5)
        if state is None or not done(state, body):
            raise RefitError(f"server {name} ({url}) did not get there within {timeout_s} s: {state}")
        return state

    async def admit(self, name: str, url: str) -> EngineState:
        """Count server ``name`` in the fleet if it is current (the fleet's version); its state, or
        ``RefitError`` with it (then it is not taken in)."""
        state = await ready_state(name, url, target=self.version, timeout_s=self.request_timeout_s)
        if not state.ready:
            raise RefitError(f"server {name} ({url}) is not current: {state}")
        self.servers[name] = url
        return state
