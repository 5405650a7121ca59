"""One DEALER socket for all of a client's requests: request ids, per-request deadlines, lost replies.

Each request gets an id and a future; a reader task hands each reply to its future. A request
that passes its deadline (the send included: it blocks while no connection is up) raises
``RefitTimeoutError`` and forgets its id, so a reply that comes later, or never, changes nothing.
Requests are idempotent on the registry (publishing the same manifest, registering, reporting a
version), so a caller may simply ask again.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Any

import zmq
import zmq.asyncio

from refitflow.core.errors import ConfigError, RefitTimeoutError
from refitflow.core.wire import PROTOCOL_VERSION, encode
from refitflow.registry.address import no_answer_hint
from refitflow.registry.messages import decode_message, error_from_reply
from refitflow.registry.security import ClientSecurity

__all__ = ["Channel"]

log = logging.getLogger(__name__)


class Channel:
    def __init__(self, address: str, *, request_timeout_s: float, security: ClientSecurity | None,
                 context: zmq.asyncio.Context | None) -> None:  # fmt: skip
        self.address = address
        self.request_timeout_s = request_timeout_s
        self._security = security
        self._own_context = context is None
        self._context = context
        self._dealer: zmq.asyncio.Socket | None = None
        self._sockets: list[zmq.asyncio.Socket] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._ids = itertools.count()
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.closed = False

    def socket(self, kind: int) -> zmq.asyncio.Socket:
        """A socket of this channel's context and security, closed with it."""
        if self.closed:
            raise ConfigError("this registry client is closed")
        if self._context is None:
            self._context = zmq.asyncio.Context()
        sock = self._context.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if self._security is not None:
            self._security.apply(sock)
        self._sockets.append(sock)
        return sock

    def spawn(self, coro: Any) -> None:
        """Run a background task until the channel closes."""
        self._tasks.append(asyncio.create_task(coro))

    def _dealer_socket(self) -> zmq.asyncio.Socket:
        if self._dealer is None:
            self._dealer = self.socket(zmq.DEALER)
            self._dealer.connect(self.address)
            self.spawn(self._read_replies(self._dealer))
        return self._dealer

    async def _read_replies(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sock.recv_multipart()
            try:
                reply = decode_message(frames[-1])
            except Exception as exc:
                log.warning("registry client: dropped a malformed reply: %s", exc)
                continue
            future = self._pending.pop(reply.get("id"), None)  # type: ignore[arg-type]
            if future is not None and not future.done():
                future.set_result(reply)  # a reply whose request gave up has no future: dropped

    async def request(self, op: str, timeout: float | None = None, **args: Any) -> Any:
        request_id = next(self._ids)
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = future
        deadline = self.request_timeout_s if timeout is None else timeout
        try:
            async with asyncio.timeout(deadline):  # the send too: it blocks while no connection is up
                await self._dealer_socket().send(encode({"v": PROTOCOL_VERSION, "id": request_id, "op": op, **args}))
                reply = await future
        except TimeoutError:
            hint = no_answer_hint(self.address, curve=self._security is not None)
            raise RefitTimeoutError(
                f"registry at {self.address} did not answer {op!r} within {deadline} s; {hint}"
            ) from None
        finally:
            self._pending.pop(request_id, None)
        if not reply.get("ok"):
            raise error_from_reply(reply)
        return reply.get("result")

    async def aclose(self) -> None:
        self.closed = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for waiting in self._pending.values():
            waiting.cancel()
        for sock in self._sockets:
            sock.close(linger=0)
        self._tasks, self._sockets, self._dealer = [], [], None
        if self._own_context and self._context is not None:
            self._context.term()
        self._context = None
