"""One DEALER socket for all of a client's requests: request ids, deadlines, lost replies, restarts, keys.

Each request gets an id and a future; a reader task hands each reply to its future. A request
that passes its deadline (the send included) raises ``RefitTimeoutError`` and forgets its id, so a
reply that comes later, or never, changes nothing. Requests are idempotent on the registry
(publishing the same manifest, registering, reporting a version), so a caller may simply ask again.

An abandoned request never takes effect later:

- the DEALER queues a request only to a live connection (``IMMEDIATE``): while the registry is away
  a send waits, and a request given up then is never sent; what was queued to a connection that
  broke is dropped with it (``replicas`` sends it again, within its deadline only);
- every request carries the registry's incarnation and a deadline on the registry's clock (both
  learnt from its answers), and the registry refuses one that arrives past its deadline (a stalled
  registry catching up on its backlog).

A broken connection (the registry's process died, its host reset the connection: the socket monitor's
``DISCONNECTED``) fails every request waiting on this channel at once with ``Lost``: ZMQ dropped what was
queued to that connection and the registry can no longer answer it, so the caller (``replicas``) sends it
to another replica, or to this one once it is back, within what is left of its deadline, instead of waiting
that deadline out. A request not sent yet (no connection: the DEALER waits for one) fails with ``Unsent`` as
soon as the monitor sees a connection attempt refused or a connection break (nobody listens there): the caller
sends it elsewhere, or here again once a connection comes up. ``up`` says what the monitor saw last (None:
nothing yet).

Every answer names the registry's incarnation: when it changes, ``on_restart`` is called (the client
re-announces what it holds). The incarnation is the client's (``Seen``), shared by the channels to every
replica of one registry: a replica first heard from after the store changed incarnation is a restart too.

A CURVE handshake the registry refuses (no key, unknown key, wrong server key: seen by the same monitor)
fails the waiting requests with ``AuthenticationError`` naming the key files, instead of a bare timeout.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import Counter
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from refitflow.core.errors import AuthenticationError, ConfigError, ManifestError, RefitTimeoutError, TransportError
from refitflow.core.wire import PROTOCOL_VERSION, encode
from refitflow.registry.address import attach, no_answer_hint
from refitflow.registry.messages import decode_message, error_from_reply
from refitflow.registry.security import ClientSecurity

__all__ = ["Channel", "Lost", "NoAnswer", "Seen", "Unsent"]

log = logging.getLogger(__name__)

_HANDSHAKE_EVENTS = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_CONNECT_RETRIED
)


class NoAnswer(RefitTimeoutError):
    """The registry did not answer in time (as opposed to a timeout it reported): another replica may."""


class Lost(NoAnswer):
    """The connection the request went out on broke before its answer came: it will never come."""


class Unsent(NoAnswer):
    """No connection to the registry came up for the request (nobody listens there): it was never sent."""


class Seen:
    """What a client learnt of the registry it speaks to, whichever replica told it: its incarnation."""

    def __init__(self) -> None:
        self.incarnation: str | None = None


class Channel:
    def __init__(
        self,
        address: str,
        *,
        request_timeout_s: float,
        security: ClientSecurity | None,
        context: zmq.asyncio.Context | None,
        on_restart: Callable[[], None] | None = None,
        seen: Seen | None = None,
    ) -> None:
        self.address = address
        self.request_timeout_s = request_timeout_s
        self._security = security
        self._on_restart = on_restart
        self._own_context = context is None
        self._context = context
        self._dealer: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None  # the DEALER's handshake events
        self._dealer_tasks: list[asyncio.Task[None]] = []
        self._sockets: list[zmq.asyncio.Socket] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._ids = itertools.count()
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._ops: dict[int, str] = {}  # request id -> its op (what ``lost`` counts)
        self._down = asyncio.Event()  # set at each sign that nobody listens (then a fresh one)
        self._no_detail = 0
        self.seen = seen or Seen()  # the registry's incarnation, from the latest answer of any replica
        self._clock_of: str | None = None  # the incarnation ``_offset`` was learnt in
        self._offset: float | None = None  # this replica's clock minus ours (a lower bound), this incarnation
        self.pub: str | None = None  # where this replica announces, as its latest answer said
        self.answering = True  # False from a request that went unanswered until the next answer
        self.up: bool | None = None  # the connection as the monitor saw it last (None: not yet seen)
        self.sent: Counter[str] = Counter()  # requests handed to a live connection, per op
        self.in_flight: Counter[str] = Counter()  # of those, the ones not answered (nor given up) yet
        self.lost: Counter[str] = Counter()  # requests failed because their connection broke, per op
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

    def spawn(self, coro: Any) -> asyncio.Task[None]:
        """Run a background task until the channel closes."""
        task = asyncio.create_task(coro)
        self._tasks = [t for t in self._tasks if not t.done()] + [task]
        return task

    def _dealer_socket(self) -> zmq.asyncio.Socket:
        if self._dealer is None:
            dealer = self.socket(zmq.DEALER)
            dealer.setsockopt(zmq.IMMEDIATE, 1)  # queue only to a live connection (see the module docstring)
            monitor = dealer.get_monitor_socket(_HANDSHAKE_EVENTS)  # before connecting: see the first handshake
            try:
                attach(dealer.connect, self.address, "cannot connect to the registry")
            except ConfigError:  # an endpoint ZMQ refuses: close both, or term() waits for them forever
                dealer.disable_monitor()
                monitor.close(linger=0)
                dealer.close(linger=0)
                self._sockets.remove(dealer)
                raise
            self._dealer, self._monitor = dealer, monitor
            self._dealer_tasks = [self.spawn(self._read_replies(dealer)), self.spawn(self._watch_handshakes(monitor))]
        return self._dealer

    def _drop_dealer(self) -> None:
        """Close the DEALER and its monitor (after a refused handshake): the next request connects afresh."""
        for task in self._dealer_tasks:
            task.cancel()
        if self._dealer is not None and self._monitor is not None:
            self._dealer.disable_monitor()
            self._monitor.close(linger=0)
            self._dealer.close(linger=0)
            self._sockets.remove(self._dealer)
        self._dealer, self._monitor, self._dealer_tasks = None, None, []

    async def _read_replies(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sock.recv_multipart()
            try:
                reply = decode_message(frames[-1])
            except Exception as exc:
                log.warning("registry client: dropped a malformed reply: %s", exc)
                continue
            self.answering = True
            self._learn(reply)
            future = self._pending.pop(reply.get("id"), None)  # type: ignore[arg-type]
            if future is not None and not future.done():
                future.set_result(reply)  # a reply whose request gave up has no future: dropped

    @property
    def incarnation(self) -> str | None:
        return self.seen.incarnation

    def _learn(self, reply: dict[str, Any]) -> None:
        """The registry's incarnation and clock from any answer, a late one included."""
        inc, now, pub = reply.get("inc"), reply.get("now"), reply.get("pub")
        if isinstance(pub, str):
            self.pub = pub
        if not isinstance(inc, str):
            return
        if inc != self._clock_of:
            self._clock_of, self._offset = inc, None
        if inc != self.seen.incarnation:
            restarted = self.seen.incarnation is not None
            self.seen.incarnation = inc
            if restarted:
                log.info("registry client: the registry at %s restarted (incarnation %s)", self.address, inc)
                if self._on_restart is not None:
                    self._on_restart()
        if isinstance(now, int | float) and not isinstance(now, bool):
            offset = now - asyncio.get_running_loop().time()  # less than the truth by the reply's delay
            self._offset = offset if self._offset is None else max(self._offset, offset)

    async def _watch_handshakes(self, monitor: zmq.asyncio.Socket) -> None:
        while True:
            event = parse_monitor_message(await monitor.recv_multipart())
            kind, value = event["event"], event["value"]
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._no_detail, self.up = 0, True
                continue
            if kind == zmq.EVENT_CONNECT_RETRIED:  # nobody listens there (yet)
                self._went_down()
                continue
            if kind == zmq.EVENT_DISCONNECTED:
                self._broken()
                continue
            if kind == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
                self._no_detail += 1  # also a registry killed mid-handshake: only a repeat counts
                if self._security is None or self._no_detail < 2:
                    continue
            self._refuse(self._why(kind, value))
            self._drop_dealer()
            return

    def _why(self, kind: int, value: int) -> str:
        where, sec = f"the registry at {self.address}", self._security
        if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            mine = "this client's key" if sec is None else f"the key of {sec.secret_key_file}"
            return (f"{where} refused {mine} (ZAP status {value}): its public key (the .key beside the "
                    "secret) must be in the registry's authorized folder")  # fmt: skip
        if kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            if sec is None:
                return (f"{where} requires CURVE and this client has no keys: give it the deployment's, "
                        "security=rf.DeploymentKeys(<folder>, role=...).client (the folder `refitflow registry` "
                        "made; the integrations: REFITFLOW_KEYS=<folder>)")  # fmt: skip
            return f"{where} does not use CURVE but this client does: drop its security, or give the registry keys"
        if kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
            return f"the handshake with {where} failed (ZMTP protocol error {value:#x}): are both sides refitflow?"
        assert sec is not None
        return (f"the CURVE handshake with {where} failed: most likely {sec.server_public_file} is not the "
                "registry's server.key (or the registry's secret key changed)")  # fmt: skip

    def _went_down(self) -> None:
        """Nobody listens there now: requests waiting to be sent give up (``Unsent``)."""
        self.up = False
        self._down.set()
        self._down = asyncio.Event()

    def _broken(self) -> None:
        """The connection broke: what waits on this channel will never be answered (see the module docstring)."""
        self._went_down()
        waiting = sum(not f.done() for f in self._pending.values())
        if waiting:
            log.info("registry client: the connection to %s broke; %d request(s) go elsewhere", self.address,
                     waiting)  # fmt: skip
        for request_id, future in list(self._pending.items()):
            if future.done():
                continue
            self.lost[self._ops.get(request_id, "")] += 1
            future.set_exception(Lost(f"the connection to the registry at {self.address} broke before it answered"))

    def _refuse(self, why: str) -> None:
        log.warning("registry client: %s", why)
        for future in list(self._pending.values()):
            if not future.done():
                future.set_exception(AuthenticationError(why))

    async def request(self, op: str, timeout: float | None = None, max_bytes: int | None = None, **args: Any) -> Any:
        """Send ``op`` with ``args``, return its result or raise its typed error; ``max_bytes``: the
        registry's size limit, checked here first (a typed error, not a dropped connection)."""
        request_id = next(self._ids)
        loop = asyncio.get_running_loop()
        deadline = self.request_timeout_s if timeout is None else timeout
        stamp: dict[str, Any] = {}
        if self.incarnation is not None:
            stamp["inc"] = self.incarnation
            if self._offset is not None:
                stamp["deadline"] = loop.time() + deadline + self._offset
        frame = encode({"v": PROTOCOL_VERSION, "id": request_id, **stamp, "op": op, **args})
        if isinstance(max_bytes, int) and len(frame) > max_bytes:
            raise ManifestError(f"the {op!r} request is {len(frame)} bytes, over the registry's limit of {max_bytes}")
        future: asyncio.Future[dict[str, Any]] = loop.create_future()
        self._pending[request_id] = future
        self._ops[request_id] = op
        sent = False
        try:
            async with asyncio.timeout(deadline):  # the send too: it waits while no connection is up
                sending: asyncio.Future[Any] = asyncio.ensure_future(self._dealer_socket().send(frame))
                down = asyncio.ensure_future(self._down.wait())
                try:
                    await asyncio.wait([sending, future, down], return_when=asyncio.FIRST_COMPLETED)
                    if not sending.done() and not future.done():  # nobody listens: never sent, go elsewhere
                        hint = no_answer_hint(self.address, curve=self._security is not None)
                        raise Unsent(f"no connection to the registry at {self.address} (nobody listens there); {hint}")
                    if sending.done() and not sending.cancelled():
                        sending.result()  # a send that failed raises here
                        self.sent[op] += 1
                        self.in_flight[op] += 1
                        sent = True
                finally:
                    sending.cancel()  # not sent yet (a refused handshake, nobody there, the deadline): never sent
                    down.cancel()
                reply = await future
        except (Lost, Unsent):
            self.answering = False
            raise
        except TimeoutError:
            self.answering = False
            hint = no_answer_hint(self.address, curve=self._security is not None)
            raise NoAnswer(f"registry at {self.address} did not answer {op!r} within {deadline} s; {hint}") from None
        except zmq.ZMQError as exc:
            raise TransportError(f"registry at {self.address}: sending {op!r} failed: {exc}") from exc
        finally:
            self._pending.pop(request_id, None)
            self._ops.pop(request_id, None)
            if sent:
                self.in_flight[op] -= 1
            if future.done() and not future.cancelled():
                future.exception()  # retrieved, even when the deadline came first
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
        if self._dealer is not None and self._monitor is not None:
            self._dealer.disable_monitor()
            self._monitor.close(linger=0)
        for sock in self._sockets:
            sock.close(linger=0)
        self._tasks, self._sockets, self._dealer, self._monitor, self._dealer_tasks = [], [], None, None, []
        if self._own_context and self._context is not None:
            self._context.term()
        self._context = None
