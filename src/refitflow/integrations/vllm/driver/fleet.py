"""Drive a fleet of vLLM servers running the ``refitflow`` backend over vLLM's own RL routes.

``await VllmFleet({"a": "http://host:8000", ...}).refit(v)`` runs, on every server at once, under one
deadline per server::

    POST /pause?mode=keep → /start_weight_update → /update_weights {"update_info": {"version": v}}
         → /finish_weight_update {"weight_version": "v"} → /resume

and returns one ``rf.EngineResult`` per server (one ``RankReport``: vLLM's routes answer for all of a
server's workers together). A server whose update failed is resumed only if it kept its previous
version (``mode="shadow"``); an ``in_place`` server that failed stays paused — fenced — until a later
version commits on it. A failed ``update_weights`` is followed by one ``finish_weight_update``: when a
worker was in doubt (it voted ready and lost the verdict, so it raised) its peers learned COMMIT and
keep vLLM's update open; finishing commits the version on them (the others refuse it, harmlessly) and
lets the next ``start_weight_update`` through, and the server stays paused — in either mode — until
the next update, where the doubtful worker learns the verdict first.

``refit(v, no_drain=True, kv="keep")`` (``mode="shadow"``) updates without draining: no pause and no
resume — start → update (answered once prepared, the servers generating all along) → finish (answered
once swapped in between two steps). A failed update leaves every server generating its previous
version; a server with a worker in doubt is paused then (its fence) until a later version commits.
A fleet that changes: ``add(name, url)`` takes a server in once it is current — a server started with
``REFITFLOW_JOIN`` catches up by itself (``join``); ``add(..., init_info=...)`` initialises a server that
was not and refits it to the fleet's version first. ``remove(name)`` forgets one; ``states()`` polls every
server's readiness route (``rf.EngineState`` each: current, catching up, behind, fenced, gone). The fleet's
version is the newest any server committed through this driver.

Needs ``httpx`` (in the ``vllm`` extra); vLLM itself is not imported.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping, Sequence
from typing import Any

import anyio

from refitflow.core.errors import ConfigError
from refitflow.engine.controller import EngineResult
from refitflow.engine.readiness import EngineState, against
from refitflow.integrations.hosting.fleet import Membership, read_starts, spread
from refitflow.integrations.hosting.http import ServerError, each_server, server_result, settle
from refitflow.integrations.hosting.http import client as _client
from refitflow.integrations.hosting.http import post as _post
from refitflow.integrations.hosting.http import step as post_step
from refitflow.integrations.hosting.info import LORA_ROOT, RefitflowInitInfo
from refitflow.integrations.lora.adapter import adapter_identity, lora_name

__all__ = ["ServerError", "VllmFleet"]


class VllmFleet(Membership):
    def __init__(
        self, servers: Mapping[str, str] | Sequence[str], *, mode: str = "in_place", pause_mode: str = "keep",
        request_timeout_s: float = 30.0, vote_timeout_s: float = 30.0,
    ) -> None:  # fmt: skip
        super().__init__(servers, request_timeout_s)
        if mode not in ("in_place", "shadow"):
            raise ConfigError(f"mode must be the backend's: 'in_place' or 'shadow', got {mode!r}")
        self.mode, self.pause_mode = mode, pause_mode
        self.vote_timeout_s = vote_timeout_s  # the backend's: an update's vote may take this long after its pull
        self.adapters: dict[str, dict[str, list[int]]] = {}  # server -> adapter -> the versions it serves by name
        self.read_starts: dict[str, float] = {}  # server -> the read_start init gave it (none: 0)

    @classmethod
    def for_backend(cls, servers: Mapping[str, str] | Sequence[str], init_info: RefitflowInitInfo) -> VllmFleet:
        return cls(servers, mode=init_info.mode, vote_timeout_s=init_info.vote_timeout_s)

    async def init(self, init_info: RefitflowInitInfo | Mapping[str, Any], *, timeout_s: float = 180.0) -> None:
        """``/init_weight_transfer_engine`` on every server; raises the first failure. Servers that read the
        trainer only (no ``serve_replicas``) and are given no ``read_start`` start reading at i / n of their
        slices (server i of n, by name): the engines spread over the trainer's ranks, not all on one pipeline
        stage at once (``rf.ReceiverConfig.read_start``)."""
        info = init_info.to_dict() if isinstance(init_info, RefitflowInitInfo) else dict(init_info)
        self.read_starts = read_starts(list(self.servers), info.get("receiver_options") or {})
        bodies = {name: {"init_info": self._started(name, info)} for name in self.read_starts}
        await self._all("init_weight_transfer_engine", {"init_info": info}, timeout_s, bodies)

    def _started(self, name: str, info: dict[str, Any]) -> dict[str, Any]:
        """``info`` with server ``name``'s ``read_start`` from ``init`` (a server added under a name ``init``
        did not know: none, it starts at 0), unless the options relay or set their own."""
        options = info.get("receiver_options") or {}
        if name not in self.read_starts or not spread(options):
            return info
        return info | {"receiver_options": options | {"read_start": self.read_starts[name]}}

    async def shutdown(self, *, timeout_s: float = 60.0) -> None:
        await self._all("shutdown_weight_transfer_engine", None, timeout_s)

    async def refit(self, version: int, *, timeout_s: float = 600.0, **update: Any) -> dict[str, EngineResult]:
        """Update every server to ``version`` (or newer); ``update``: more ``RefitflowUpdateInfo`` fields."""
        info = {"version": version, "timeout_s": timeout_s, **update}
        if info.get("no_drain") and self.mode != "shadow":
            raise ConfigError("no_drain updates need mode='shadow' (the previous version serves while one prepares)")
        async with self.membership:
            return self.note(await each_server(self.servers, lambda n, u: self._refit_one(n, u, info, timeout_s)))

    async def add(self, name: str, url: str, *, init_info: RefitflowInitInfo | Mapping[str, Any] | None = None,
                  timeout_s: float = 600.0) -> EngineState:  # fmt: skip
        """Take server ``name`` in (a name already known is replaced: a restarted or moved server) once it is
        current; its state. Without ``init_info`` the server catches up by itself (started with
        ``REFITFLOW_JOIN``: ``join``) and this waits for its readiness route to say so; with it, this
        initialises the server and refits it to the fleet's version first (it served what it loaded until
        then). Not current within ``timeout_s``: ``RefitError`` with its state, and it is not taken in."""
        url = url.rstrip("/")
        if init_info is None:  # its own catch-up (REFITFLOW_JOIN) first: from its peers, ahead of this refit
            state = await self.wait_until(
                name, url, timeout_s, lambda s, body: s.ready or body.get("caught_up") is not None
            )
        else:
            info = init_info.to_dict() if isinstance(init_info, RefitflowInitInfo) else dict(init_info)
            info = self._started(name, info)  # a restarted server starts where it did
            async with _client(url, self.request_timeout_s) as http:
                await _post(http, "init_weight_transfer_engine", {"init_info": info}, timeout=timeout_s)
            state = None
        async with self.membership:  # no refit of the fleet completes meanwhile
            if state is None or not against(state, self.version).ready:  # a joiner's is the driver's to finish
                update = {"version": self.version or 0, "timeout_s": timeout_s}
                self.note({name: await self._refit_one(name, url, update, timeout_s)})
            return await self.admit(name, url)

    def remove(self, name: str) -> None:
        super().remove(name)
        self.adapters.pop(name, None)

    async def answering(self, min_version: int, *, timeout_s: float = 5.0) -> list[str]:
        """The servers that can answer a request asking for ``min_version`` now (``min_version.py``: the others
        answer it 409): those that serve a committed version ``>= min_version`` — current, or behind the fleet
        but serving (shadow) — by their readiness routes; fenced, catching-up and gone servers never."""
        states = await self.states(timeout_s=timeout_s)
        return sorted(n for n, s in states.items() if s.state in ("current", "behind") and s.version is not None
                      and s.version >= min_version)  # fmt: skip

    async def refit_adapter(self, adapter: str, version: int, *, max_staleness: int = 1, timeout_s: float = 120.0,
                            lora_root: str = LORA_ROOT) -> dict[str, EngineResult]:  # fmt: skip
        """Serve LoRA ``adapter`` ``version`` on every server under its own name ``adapter@v<version>`` (vLLM started
        with ``--enable-lora`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``): every worker lands it (verified, its
        base version checked), then vLLM loads it; generation never stops. The ``max_staleness`` versions
        before it stay served (requests naming them go on), older ones are unloaded. docs/lora.md."""
        if not isinstance(max_staleness, int) or max_staleness < 0:
            raise ConfigError(f"max_staleness must be a non-negative number of versions, got {max_staleness!r}")
        adapter_identity(adapter)  # a plain name, or a ConfigError here
        return await each_server(self.servers, lambda name, url: self._adapter_one(
            name, url, adapter, version, f"{lora_root.rstrip('/')}/{name}", max_staleness, timeout_s))  # fmt: skip

    async def checksums(self, *, timeout_s: float = 120.0) -> dict[str, dict[str, str]]:
        """Every server's ``/weight_checker`` checksums."""
        replies = await self._all("weight_checker", {"action": "checksum"}, timeout_s)
        return {name: dict(r["checksums"]) for name, r in replies.items()}

    async def compare(self, baseline: Mapping[str, str], *, timeout_s: float = 120.0) -> dict[str, list[str]]:
        """Every server's mismatches against ``baseline`` (``checksums.expected_checksums``): empty = match."""
        replies = await self._all("weight_checker", {"action": "compare", "baseline": dict(baseline)}, timeout_s)
        return {name: list(r["mismatches"]) for name, r in replies.items()}

    # -- one server --------------------------------------------------------------------------------

    async def _refit_one(self, name: str, url: str, info: dict[str, Any], timeout_s: float) -> EngineResult:
        deadline = time.monotonic() + timeout_s + self.vote_timeout_s + 2 * self.request_timeout_s
        version, no_drain = info["version"], bool(info.get("no_drain"))
        step, error = "pause", None
        pause = {"mode": self.pause_mode}
        async with _client(url, self.request_timeout_s) as http:
            try:
                with anyio.fail_after(max(deadline - time.monotonic(), 0.001)):
                    if not no_drain:
                        await _post(http, "pause", None, params=pause)
                    step = "start_weight_update"
                    await _post(http, step, None)
                    step = "update_weights"
                    wait = timeout_s + self.vote_timeout_s + self.request_timeout_s
                    await _post(http, step, {"update_info": info}, timeout=wait)
                    step = "finish_weight_update"
                    await _post(http, step, {"weight_version": str(version)})
            except (ServerError, TimeoutError) as exc:
                error = exc if isinstance(exc, ServerError) else ServerError(step, None, f"deadline of {timeout_s} s")
            if error is not None and step == "update_weights":
                # finish it on the workers that voted COMMIT and keep it open (a peer was in doubt); the workers
                # whose update failed refuse it, which is the usual answer (every worker failed): ignored
                await post_step(http, "finish_weight_update", None, self.request_timeout_s)
                if no_drain and "in doubt" in str(error):  # its workers may now hold two versions: fence it
                    with contextlib.suppress(ServerError):
                        await _post(http, "pause", None, params=pause, timeout=self.request_timeout_s)
            # an update that got as far as pulling may have written (vLLM answers with the first failing worker's
            # error, "in doubt" among them)
            return await settle(http, name, version, committed=error is None, error=error, paused=self.paused,
                                wrote=step in ("update_weights", "finish_weight_update"),
                                in_place=self.mode == "in_place",
                                resume=None if no_drain else ("resume", None),
                                timeout_s=self.request_timeout_s)  # fmt: skip

    async def _adapter_one(self, name: str, url: str, adapter: str, version: int, root: str, staleness: int,
                           timeout_s: float) -> EngineResult:  # fmt: skip
        served = self.adapters.setdefault(name, {}).setdefault(adapter, [])
        info = {"version": version, "adapter": adapter, "lora_root": root, "keep": staleness + 1,
                "timeout_s": timeout_s}  # fmt: skip
        step, error = "update_weights", None
        async with _client(url, self.request_timeout_s) as http:
            try:
                with anyio.fail_after(timeout_s + 2 * self.request_timeout_s):
                    await _post(http, step, {"update_info": info}, timeout=timeout_s + self.request_timeout_s)
                    step = "v1/load_lora_adapter"
                    await _post(http, step, {"lora_name": lora_name(adapter, version),
                                             "lora_path": f"{root}/{lora_name(adapter, version)}"})  # fmt: skip
            except (ServerError, TimeoutError) as exc:
                error = exc if isinstance(exc, ServerError) else ServerError(step, None, f"deadline of {timeout_s} s")
            if error is None:
                served.append(version)
                for old in [v for v in served if v < version - staleness]:  # past the staleness: no longer named
                    if await post_step(http, "v1/unload_lora_adapter", {"lora_name": lora_name(adapter, old)},
                                       self.request_timeout_s) is None:  # fmt: skip
                        served.remove(old)
        return server_result(name, version, committed=error is None, fenced=False, error=error)

    async def _all(self, route: str, body: dict[str, Any] | None, timeout_s: float,
                   bodies: Mapping[str, dict[str, Any]] | None = None) -> dict[str, Any]:  # fmt: skip
        """``route`` on every server (``bodies``: a server's own body, else ``body``); the first failure raised."""
        replies: dict[str, Any] = {}
        errors: list[ServerError] = []

        async def one(name: str, url: str) -> None:
            async with _client(url, timeout_s) as http:
                try:
                    replies[name] = await _post(http, route, (bodies or {}).get(name, body))
                except ServerError as exc:
                    errors.append(exc)

        with anyio.move_on_after(timeout_s + self.request_timeout_s):
            async with anyio.create_task_group() as tg:
                for name, url in self.servers.items():
                    tg.start_soon(one, name, url)
        missing = sorted(set(self.servers) - set(replies))
        if errors or missing:
            raise errors[0] if errors else ServerError(route, None, f"servers {missing} did not answer in time")
        return replies
