"""Drive a fleet of SGLang servers that run refitflow's loader, over SGLang's own HTTP routes.

``await SglangFleet({"a": "http://host:30000"}, init, tp=4).refit(v)`` runs, on every server at once,
under one deadline per server::

    POST /pause_generation {"mode": pause_mode} → /begin_weight_update {"selector": "target"}
         → /update_weights_from_tensor {serialized_named_tensors: payload.encode(...), load_format: LOADER,
                                        weight_version: "v", flush_cache: true}
         → /end_weight_update → /continue_generation

and returns one ``rf.EngineResult`` per server (one ``RankReport``: SGLang answers for all of a server's
ranks, with its TP rank 0's result; the engine vote makes every rank's outcome the same, except a rank
in doubt). ``/end_weight_update`` is posted whenever ``/begin_weight_update`` was sent (its answer may be
lost while the session opened), shielded from cancellation, so SGLang's update session is always
closed. A server whose update failed is continued only if it kept its previous version
(``mode="shadow"``, and not in doubt); an ``in_place`` server that failed stays paused — fenced — until
a later version commits on it (``paused`` lists them).

A fleet that changes: ``add(name, url)`` refits a server that joined (started with ``REFITFLOW_JOIN=1``, it
refuses requests until then) to the fleet's version — the newest a server committed through this driver —
reading from the peers that relay it, and takes it in once its readiness route says current; ``remove``
forgets one; ``states()`` polls every server's readiness (``rf.EngineState``). Needs ``httpx`` (the ``sglang``
extra); SGLang itself is not imported.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from typing import Any

import anyio

from refitflow.core.errors import ConfigError
from refitflow.engine.controller import EngineResult
from refitflow.engine.readiness import EngineState
from refitflow.integrations.hosting.fleet import Membership, read_starts
from refitflow.integrations.hosting.http import ServerError, client, each_server, post, settle
from refitflow.integrations.hosting.http import step as post_step
from refitflow.integrations.hosting.info import RefitflowInitInfo, RefitflowUpdateInfo
from refitflow.integrations.sglang.payload import LOADER, encode

__all__ = ["SglangFleet"]

PAUSE_MODES = ("abort", "retract", "in_place")


class SglangFleet(Membership):
    def __init__(
        self, servers: Mapping[str, str] | Sequence[str], init: RefitflowInitInfo, *, tp: int = 1,
        pause_mode: str | None = "retract", request_timeout_s: float = 30.0,
    ) -> None:  # fmt: skip
        super().__init__(servers, request_timeout_s)
        if pause_mode is not None and pause_mode not in PAUSE_MODES:
            raise ConfigError(f"pause_mode must be one of {PAUSE_MODES} or None (no pause), got {pause_mode!r}")
        if tp < 1:
            raise ConfigError(f"tp must be the servers' TP size (at least 1), got {tp}")
        self.init, self.tp, self.pause_mode = init, tp, pause_mode
        # server i of n starts reading at i / n of its slices (``read_starts``); a server added later at 0
        self.read_starts = read_starts(list(self.servers), init.receiver_options)

    async def refit(
        self, version: int, *, timeout_s: float = 600.0, wait_s: float | None = None
    ) -> dict[str, EngineResult]:
        """Update every server to ``version`` (or newer); bad arguments are a ``ConfigError`` before any server
        is asked."""
        bodies = {name: self._body(name, version, timeout_s, wait_s) for name in self.servers}
        async with self.membership:
            return self.note(await each_server(self.servers, lambda n, u: self._refit_one(
                n, u, version, bodies[n], timeout_s)))  # fmt: skip

    async def add(self, name: str, url: str, *, timeout_s: float = 600.0) -> EngineState:
        """Refit server ``name`` (a name already known is replaced: a restarted or moved server) to the fleet's
        version, then take it in once its readiness route says current; its state. Not current within
        ``timeout_s``: ``RefitError`` with its state, and it is not taken in."""
        url = url.rstrip("/")
        async with self.membership:
            version = self.version or 0
            body = self._body(name, version, timeout_s, None)
            self.note({name: await self._refit_one(name, url, version, body, timeout_s)})
            return await self.admit(name, url)

    def _body(self, name: str, version: int, timeout_s: float, wait_s: float | None) -> dict[str, Any]:
        update = RefitflowUpdateInfo(version=version, timeout_s=timeout_s, wait_s=wait_s)
        init = self.init
        if name in self.read_starts:
            options = init.receiver_options | {"read_start": self.read_starts[name]}
            init = dataclasses.replace(init, receiver_options=options)
        return {"serialized_named_tensors": encode(init, update, tp=self.tp), "load_format": LOADER,
                "flush_cache": True, "weight_version": str(version), "selector": "target"}  # fmt: skip

    async def _refit_one(
        self, name: str, url: str, version: int, body: dict[str, Any], timeout_s: float
    ) -> EngineResult:
        deadline = time.monotonic() + timeout_s + self.init.vote_timeout_s + 3 * self.request_timeout_s
        step, error, began = "pause_generation", None, False
        async with client(url, self.request_timeout_s) as http:
            try:
                with anyio.fail_after(max(deadline - time.monotonic(), 0.001)):
                    if self.pause_mode is not None:
                        await post(http, step, {"mode": self.pause_mode})
                    # from here on the session may be open even if begin's answer never comes: end it always
                    step, began = "begin_weight_update", True
                    await post(http, step, {"selector": "target"})
                    step = "update_weights_from_tensor"
                    await post(http, step, body, timeout=timeout_s + self.init.vote_timeout_s + self.request_timeout_s)
            except (ServerError, TimeoutError) as exc:
                error = exc if isinstance(exc, ServerError) else ServerError(step, None, f"deadline of {timeout_s} s")
            committed = error is None  # the update's own outcome: a failed end after it does not undo a commit
            if began:  # close SGLang's update session in every case (the next begin refuses an open one)
                ended = await post_step(http, "end_weight_update", {}, self.request_timeout_s)  # after a failure too
                error = error or ended
            # an update that reached the loader may have written
            return await settle(http, name, version, committed=committed, error=error, paused=self.paused,
                                wrote=step == "update_weights_from_tensor", in_place=self.init.mode == "in_place",
                                resume=None if self.pause_mode is None else ("continue_generation", {}),
                                timeout_s=self.request_timeout_s)  # fmt: skip
