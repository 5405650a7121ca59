"""The registry as a ZMQ service: a ROUTER answers requests, a PUB announces complete versions.

State and rules live in the wrapped store (``registry.protocol.Store``: in memory, or etcd); this module only speaks the
protocol (``messages``), admits requests (``admission``: size, requests in flight, staleness), runs
one task per request (so long waits don't block others), expires stale leases, and never lets one
bad message stop it serving everyone else. Every answer carries the service's *incarnation* (new at
every start) and clock, so a client learns of a restart from any answer and can put deadlines on
its requests in this registry's time.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import zmq
import zmq.asyncio

from refitflow.core.errors import ConfigError, ManifestError
from refitflow.core.wire import PROTOCOL_VERSION, encode
from refitflow.registry.address import check_address
from refitflow.registry.limits import RegistryLimits
from refitflow.registry.messages import error_reply, identity_from_dict, ok_reply, topic
from refitflow.registry.protocol import Store
from refitflow.registry.roles import KeyRoles
from refitflow.registry.security import ServerSecurity, check_exposed
from refitflow.registry.service.admission import Gate, check_fresh, request_id_of
from refitflow.registry.service.frames import SMALL_BYTES, decode_request
from refitflow.registry.service.gc_pause import GcPause
from refitflow.registry.service.ops import Handler
from refitflow.registry.service.store import RegistryStore

__all__ = ["RegistryServer", "serve"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class RegistryServer:
    address: str  # the bound request endpoint (a ``*`` port resolved)
    pub_address: str  # where announcements are published
    registry: Store
    incarnation: str  # new at every start: clients that see it change re-announce what they hold


def _bind_pub(pub: zmq.asyncio.Socket, address: str) -> None:
    """PUB at a place derived from the request endpoint, so a restart on the same address lands there
    too (TCP: the next port, or a free one if that is taken; clients re-learn it from ``hello``)."""
    scheme, _, rest = address.partition("://")
    if scheme != "tcp":
        pub.bind(f"{address}.pub")
        return
    host, port = rest.rsplit(":", 1)
    try:
        pub.bind(f"tcp://{host}:{int(port) + 1}")
    except zmq.ZMQError as exc:
        log.info("registry: announcements on a free port (%s:%d: %s)", host, int(port) + 1, exc)
        pub.bind(f"tcp://{host}:*")


@asynccontextmanager
async def serve(
    address: str = "tcp://127.0.0.1:7100",
    *,
    registry: Store | None = None,
    lease_s: float = 10.0,
    security: ServerSecurity | None = None,
    pub_address: str | None = None,
    limits: RegistryLimits | None = None,
    freeze_gc: bool = False,
    insecure: bool = False,
) -> AsyncIterator[RegistryServer]:
    """Serve ``registry`` (a new one by default, with ``lease_s`` and ``limits``) at ``address`` until the
    context exits (asyncio only).

    ``limits`` (``RegistryLimits``) bound what one request and all requests in flight may hold; a
    request beyond them is answered at once with a typed error (``RefitTimeoutError`` "busy" for a full
    house), so a flood cannot pile up tasks or memory. A given ``registry`` keeps its own store limits.
    ``freeze_gc``: the process is the registry's own (``refitflow registry``): Python's cyclic collector is
    paused while a large request is handled, and what it left is then frozen out of later passes
    (``gc_pause.py``); its passes otherwise stop the loop for long.
    ``security`` (CURVE): required for an address other hosts reach, unless ``insecure=True`` (logged).
    """
    check_address(address)
    if security is None:
        for bound in (address, pub_address or ""):
            check_exposed(bound, "the registry", insecure=insecure)
    registry = registry or RegistryStore(lease_s=lease_s, limits=limits)
    # a replicated store's replicas share one incarnation: a client failing over to another is no restart
    incarnation = getattr(registry, "incarnation", "") or uuid.uuid4().hex
    limits = limits or registry.limits
    ctx = zmq.asyncio.Context()
    auth, roles = None, None
    try:
        if security is not None:
            from zmq.auth import load_certificate
            from zmq.auth.asyncio import AsyncioAuthenticator

            auth = AsyncioAuthenticator(ctx)
            auth.start()
            roles = security.allow(auth)  # what each admitted key may ask (``registry/roles.py``)
            if roles.legacy:
                log.warning("registry: %s hold every role (a key folder made before per-role keys): "
                            "`refitflow keys %s` adds trainer, rollout and operator pairs; then move these out "
                            "of the allow-list", ", ".join(str(p) for p in roles.legacy),
                            Path(security.authorized_dir).parent)  # fmt: skip
            public, secret = load_certificate(str(security.secret_key_file))
        router, pub = ctx.socket(zmq.ROUTER), ctx.socket(zmq.PUB)
        for sock in (router, pub):
            sock.setsockopt(zmq.LINGER, 0)
            if security is not None:
                sock.curve_secretkey, sock.curve_publickey, sock.curve_server = secret, public, True
        # over the limit but under twice it: a typed answer; beyond: ZMQ drops the connection unread
        router.setsockopt(zmq.MAXMSGSIZE, min(2 * limits.max_message_bytes, (1 << 62)))
        router.setsockopt(zmq.ROUTER_MANDATORY, 0)
        try:
            router.bind(address)
            bound = router.getsockopt_string(zmq.LAST_ENDPOINT)
            if pub_address:
                pub.bind(pub_address)
            else:
                _bind_pub(pub, bound)
        except zmq.ZMQError as exc:
            raise ConfigError(f"cannot bind the registry at {address}: {exc}") from exc
        server = RegistryServer(
            address=bound,
            pub_address=pub.getsockopt_string(zmq.LAST_ENDPOINT),
            registry=registry,
            incarnation=incarnation,
        )
        hello = {"lease_s": registry.lease_s, "pub": server.pub_address, "protocol": PROTOCOL_VERSION,
                 "incarnation": server.incarnation, "max_message_bytes": limits.max_message_bytes}  # fmt: skip
        announce = _announcer(pub)
        if registry.announces:
            registry.on_announce = announce  # type: ignore[attr-defined]
        handler = Handler(registry, hello=hello, limits=limits, announce=announce)
        service = _Service(router, handler, Gate(limits), server.incarnation, server.pub_address, GcPause(freeze_gc),
                           roles)  # fmt: skip
        # plain tasks, not a task group around the yield: the caller's own errors stay unwrapped
        tasks = [
            asyncio.create_task(service.run()),
            asyncio.create_task(_expire_leases(registry)),
        ]
        for task in tasks:
            task.add_done_callback(_log_crash)
        try:
            yield server
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        if auth is not None:
            auth.stop()
            # its ZAP task's cancellation removes the ZAP socket's descriptor from the loop: let it run before the
            # descriptors close, or that removal, late, hits the number's next owner — the ZAP socket of a registry
            # served next on this loop, whose clients' handshakes would then never be answered
            for _ in range(2):
                await asyncio.sleep(0)
        ctx.destroy(linger=0)


def _announcer(pub: zmq.asyncio.Socket) -> Any:
    async def announce(identity_dict: dict[str, str], version: int) -> None:
        identity = identity_from_dict(identity_dict)
        await pub.send_multipart([topic(identity), encode({"v": PROTOCOL_VERSION, "identity": identity_dict,
                                                          "version": version})])  # fmt: skip

    return announce


class _Service:
    def __init__(self, router: zmq.asyncio.Socket, handler: Handler, gate: Gate, incarnation: str, pub_address: str,
                 gc_pause: GcPause, roles: KeyRoles | None) -> None:  # fmt: skip
        self.router, self.handler, self.gate, self.incarnation = router, handler, gate, incarnation
        self.pub_address, self.gc_pause, self.roles = pub_address, gc_pause, roles
        self._store = handler.registry

    def _returning(self) -> None:
        """A client of an earlier incarnation is back: its peers may not have re-registered yet."""
        self._store.hold_releases(self._store.lease_s)

    def _stamp(self) -> dict[str, Any]:
        # ``pub``: where this process announces — a replica restarted over a shared store keeps the incarnation
        # but may announce elsewhere (its usual port taken): clients re-learn it (``RegistryClient.hello``)
        return {"inc": self.incarnation, "now": time.monotonic(), "pub": self.pub_address}

    async def run(self) -> None:
        async with anyio.create_task_group() as tg:
            while True:
                frames = await self.router.recv_multipart(copy=False)
                peer = frames[0].bytes
                if len(frames) != 2:  # a DEALER sends exactly one frame
                    why = ManifestError(f"a request is one frame, this message had {len(frames) - 1}")
                    tg.start_soon(self._send, peer, error_reply(None, why, self._stamp()))
                    continue
                body = frames[1].bytes
                client, host, key = _sender(frames[1], peer)
                refused = self.gate.admit(client, host, len(body))
                if refused is not None:
                    tg.start_soon(self._send, peer, error_reply(request_id_of(body), refused, self._stamp()))
                    continue
                tg.start_soon(self._answer, peer, client, host, body, key)

    async def _answer(self, peer: bytes, client: bytes, host: bytes, body: bytes, key: str) -> None:
        request_id: Any = None
        try:
            with self.gc_pause.during(len(body) > SMALL_BYTES):
                msg = await decode_request(body, self.handler.limits.max_shards)
                request_id = msg.get("id")
                check_fresh(msg, self.incarnation, self._returning)
                if self.roles is not None:
                    self.roles.admit(msg, key)  # the key's role may send it; its owner is the key's own
                reply = ok_reply(request_id, await self.handler.handle(msg), self._stamp())
        except Exception as exc:  # every failure becomes an error reply; the service keeps serving
            reply = error_reply(request_id, exc, self._stamp())
        finally:
            self.gate.done(client, host, len(body))
        await self._send(peer, reply)

    async def _send(self, peer: bytes, reply: bytes) -> None:
        try:
            await self.router.send_multipart([peer, reply])
        except zmq.ZMQError as exc:  # the peer went away: its reply is lost, as on any network
            log.info("registry: reply to a departed peer dropped: %s", exc)


def _sender(frame: zmq.Frame, peer: bytes) -> tuple[bytes, bytes, str]:
    """Who sent a frame, for the limits and roles: (client, host, key). The client is its connection, or its CURVE
    key and host where CURVE is on (one key may serve many processes); the host, the IP address it came from
    (many sockets from one host share the per-host quota); the key, its CURVE public key (z85; "" when open)."""

    def prop(name: str) -> str:
        try:
            value = frame.get(name)
        except zmq.ZMQError:
            return ""
        return value if isinstance(value, str) else ""

    key, address = prop("User-Id"), prop("Peer-Address")
    # loopback: the registry's own machine (whoever is there can do worse): each connection its own "host"
    host = b"host:" + address.encode() if address and not _loopback(address) else peer
    return (b"key:" + key.encode() + b"|" + host if key else peer), host, key


def _loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.strip("[]")).is_loopback
    except ValueError:
        return False


def _log_crash(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("registry: a service task failed", exc_info=task.exception())


async def _expire_leases(registry: Store) -> None:
    """Every ``lease_s / 4``: expire stale leases; a tick late by more than a tenth of a lease (the registry
    stalled: a huge frame, a paused process) first extends every lease by the delay, since heartbeats sent
    meanwhile are still queued, unread: a lease never expires because the registry was busy."""
    period = registry.lease_s / 4
    while True:
        before = time.monotonic()
        await anyio.sleep(period)
        late = time.monotonic() - before - period
        if late > registry.lease_s / 10:
            log.warning("registry: stalled for %.1f s; leases extended by as much", late)
            registry.extend_leases(late)
        stale = registry.expire()
        if stale:
            log.info("registry: leases expired for %d owner(s)", len(stale))
