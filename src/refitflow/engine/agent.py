"""The rank side of the controller: one inference rank listening for refit commands over ZMQ.

Protocol (DEALER → ROUTER, one orjson frame each way):

- ``{"op": "refit", "id": n, "version": v, "timeout": s}`` → the rank's ``EngineMember.refit`` with
  attempt id ``n`` (every rank of the engine gets the same ``n``, so a late ballot from an earlier
  command is never counted), answered ``{"id", "ok": true, "result": report}``;
- ``{"op": "status", "id": n}`` → the receiver's status;
- ``{"op": "stop", "id": n}`` → answered, then ``serve`` returns.

One command at a time: a refit that arrives while one runs is answered ``ok: false`` (busy). A
command that is not exactly one of these (fields, types, ranges, one frame) is answered
``ok: false`` and never obeyed. While the rank is in doubt about a vote it asks its peers every
``resolve_every_s`` in the background. ``security`` makes the ROUTER a CURVE server that admits
only the deployment's allow-list (``rf.ServerSecurity``); without it, bind loopback only.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import anyio
import zmq
import zmq.asyncio

from refitflow.core.wire import encode
from refitflow.engine.member import EngineMember
from refitflow.engine.vote import decode_object
from refitflow.registry.address import attach
from refitflow.registry.security import ServerSecurity, check_exposed

__all__ = ["EngineAgent", "parse_command"]

log = logging.getLogger(__name__)

MAX_COMMAND = 4096  # bytes: a command is < 200
_OPS = ("refit", "status", "stop")


def parse_command(frame: bytes) -> dict[str, Any]:
    """A command, checked field by field (``ValueError`` for anything else)."""
    m = decode_object(frame, MAX_COMMAND, "command")
    if m.get("op") not in _OPS:
        raise ValueError(f"unknown command {str(m)[:60]!r}")
    if type(m.get("id")) is not int or not 0 <= m["id"] < 1 << 63:
        raise ValueError("a command id is a non-negative integer")
    if m["op"] == "refit":
        version, timeout = m.get("version"), m.get("timeout", 60.0)
        if version is not None and (type(version) is not int or not 0 <= version < 1 << 63):
            raise ValueError("a refit version is a non-negative integer or null")
        if type(timeout) not in (int, float) or not (0 < timeout <= 86400 and math.isfinite(timeout)):
            raise ValueError("a refit timeout is a positive number of seconds (at most a day)")
        return {"op": "refit", "id": m["id"], "version": version, "timeout": float(timeout)}
    return {"op": m["op"], "id": m["id"]}


class EngineAgent:
    """Serves ``member`` (one rank of an engine) to a ``Controller`` on ``address`` (bound here)."""

    def __init__(self, member: EngineMember, address: str, *, security: ServerSecurity | None = None,
                 resolve_every_s: float = 1.0, insecure: bool = False) -> None:  # fmt: skip
        if security is None:
            check_exposed(address, "the engine agent", insecure=insecure)
        self.member = member
        self.address = address
        self.security = security
        self.resolve_every_s = resolve_every_s
        self._busy = False
        self.refused = 0  # commands refused as malformed

    async def serve(self) -> None:
        """Answer commands until a ``stop`` command (cancel the caller to stop otherwise)."""
        context = zmq.asyncio.Context()
        auth = None
        router = context.socket(zmq.ROUTER)
        try:
            if self.security is not None:
                auth = self.security.authenticator(context)
            router.setsockopt(zmq.LINGER, 1000)  # the last reply gets a moment to leave
            router.setsockopt(zmq.MAXMSGSIZE, MAX_COMMAND)
            if self.security is not None:
                self.security.apply(router)
            attach(router.bind, self.address, "cannot bind the engine agent")
            stop = anyio.Event()
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._read, router, tg, stop)
                tg.start_soon(self._resolve_doubts)
                await stop.wait()
                tg.cancel_scope.cancel()
        finally:
            router.close()  # every socket closed before term(), which waits for them (forever, else)
            if auth is not None:
                auth.stop()
            context.term()

    async def _resolve_doubts(self) -> None:
        while True:
            await anyio.sleep(self.resolve_every_s)
            if self.member.in_doubt is not None and not self._busy:
                outcome = await self.member.resolve()
                if outcome is not None:
                    log.info("engine agent: attempt %d resolved: %s", outcome.attempt, outcome.decision.value)

    async def _read(self, router: zmq.asyncio.Socket, tg: anyio.abc.TaskGroup, stop: anyio.Event) -> None:
        while True:
            frames = await router.recv_multipart()
            if len(frames) != 2:  # a DEALER sends exactly one frame (after its identity)
                self.refused += 1
                continue
            peer, frame = frames
            try:
                m = parse_command(frame)
            except Exception as exc:  # answered, never obeyed
                self.refused += 1
                log.warning("engine agent: refused a malformed command: %.200s", exc)
                await self._reply(router, peer, None, False, f"malformed command: {exc}")
                continue
            op, request_id = m["op"], m["id"]
            if op == "refit" and not self._busy:
                self._busy = True
                tg.start_soon(self._refit, router, peer, request_id, m)
            elif op == "refit":
                await self._reply(router, peer, request_id, False, "busy: a refit is already running")
            elif op == "status":
                await self._reply(router, peer, request_id, True, _status(self.member))
            else:
                await self._reply(router, peer, request_id, True, None)
                stop.set()

    async def _refit(self, router: zmq.asyncio.Socket, peer: bytes, request_id: int, m: dict[str, Any]) -> None:
        try:
            set_attempt = getattr(self.member.channel, "set_attempt", None)
            if set_attempt is not None:
                set_attempt(request_id)
            outcome = await self.member.refit(m["version"], timeout=m["timeout"])
            result = outcome.result
            report = {
                "committed": outcome.committed, "decision": outcome.decision.value, "version": outcome.version,
                "error": None if outcome.error is None else repr(outcome.error), **_status(self.member),
                "pulled_bytes": getattr(result, "nbytes", 0), "relay_bytes": getattr(result, "relay_bytes", 0),
            }  # fmt: skip
            await self._reply(router, peer, request_id, True, report)
        except Exception as exc:  # reported, never fatal to the agent
            await self._reply(router, peer, request_id, False, f"{type(exc).__name__}: {exc}")
        finally:
            self._busy = False

    @staticmethod
    async def _reply(router: zmq.asyncio.Socket, peer: bytes, request_id: Any, ok: bool, result: Any) -> None:
        try:
            await router.send_multipart([peer, encode({"id": request_id, "ok": ok, "result": result})],
                                        flags=zmq.NOBLOCK)  # fmt: skip
        except zmq.ZMQError as exc:  # the peer went away (or floods us): its answer is lost
            log.info("engine agent: reply dropped: %s", exc)


def _status(member: EngineMember) -> dict[str, Any]:
    ledger = member.receiver.ledger
    return {"committed_version": ledger.committed_version, "fence": ledger.fence.state.value,
            "reason": ledger.fence.reason, "healthy": ledger.fence.state.value != "fenced",
            "in_doubt": member.in_doubt}  # fmt: skip
