"""The rank side of the controller: one inference rank listening for refit commands over ZMQ.

Protocol (DEALER → ROUTER, one orjson frame each way):

- ``{"op": "refit", "id": n, "version": v, "timeout": s}`` → the rank's ``EngineMember.refit`` with
  attempt id ``n`` (every rank of the engine gets the same ``n``, so a late ballot from an earlier
  command is never counted), answered ``{"id", "ok": true, "result": report}``;
- ``{"op": "status", "id": n}`` → the receiver's status;
- ``{"op": "stop", "id": n}`` → answered, then ``serve`` returns.

One command at a time: a refit that arrives while one runs is answered ``ok: false`` (busy).
"""

from __future__ import annotations

import logging
from typing import Any

import anyio
import zmq
import zmq.asyncio

from refitflow.core.wire import decode, encode
from refitflow.engine.member import EngineMember

__all__ = ["EngineAgent"]

log = logging.getLogger(__name__)


class EngineAgent:
    """Serves ``member`` (one rank of an engine) to a ``Controller`` on ``address`` (bound here)."""

    def __init__(self, member: EngineMember, address: str) -> None:
        self.member = member
        self.address = address
        self._busy = False

    async def serve(self) -> None:
        """Answer commands until a ``stop`` command (cancel the caller to stop otherwise)."""
        context = zmq.asyncio.Context()
        router = context.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 1000)  # the last reply gets a moment to leave
        router.bind(self.address)
        stop = anyio.Event()
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._read, router, tg, stop)
                await stop.wait()
                tg.cancel_scope.cancel()
        finally:
            router.close()
            context.term()

    async def _read(self, router: zmq.asyncio.Socket, tg: anyio.abc.TaskGroup, stop: anyio.Event) -> None:
        while True:
            peer, frame = (await router.recv_multipart())[-2:]
            try:
                m: Any = decode(frame)
                op, request_id = m["op"], m["id"]
            except Exception as exc:
                log.warning("engine agent: dropped a malformed command: %s", exc)
                continue
            if op == "refit" and not self._busy:
                self._busy = True
                tg.start_soon(self._refit, router, peer, request_id, m)
            elif op == "refit":
                await self._reply(router, peer, request_id, False, "busy: a refit is already running")
            elif op == "status":
                await self._reply(router, peer, request_id, True, _status(self.member))
            elif op == "stop":
                await self._reply(router, peer, request_id, True, None)
                stop.set()
            else:
                await self._reply(router, peer, request_id, False, f"unknown op {op!r}")

    async def _refit(self, router: zmq.asyncio.Socket, peer: bytes, request_id: int, m: dict[str, Any]) -> None:
        try:
            set_attempt = getattr(self.member.channel, "set_attempt", None)
            if set_attempt is not None:
                set_attempt(int(request_id))
            outcome = await self.member.refit(m.get("version"), timeout=float(m.get("timeout", 60.0)))
            report = {
                "committed": outcome.committed, "decision": outcome.decision.value, "version": outcome.version,
                "error": None if outcome.error is None else repr(outcome.error), **_status(self.member),
            }  # fmt: skip
            await self._reply(router, peer, request_id, True, report)
        except Exception as exc:  # reported, never fatal to the agent
            await self._reply(router, peer, request_id, False, f"{type(exc).__name__}: {exc}")
        finally:
            self._busy = False

    @staticmethod
    async def _reply(router: zmq.asyncio.Socket, peer: bytes, request_id: Any, ok: bool, result: Any) -> None:
        await router.send_multipart([peer, encode({"id": request_id, "ok": ok, "result": result})])


def _status(member: EngineMember) -> dict[str, Any]:
    s = member.receiver.status
    return {"committed_version": s.committed_version, "fence": s.fence, "healthy": s.healthy}
