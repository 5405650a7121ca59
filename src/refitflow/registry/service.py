"""The registry as a ZMQ service: a ROUTER answers requests, a PUB announces complete versions.

State and rules live in the wrapped :class:`RegistryStore`; this module only speaks the
protocol (``_messages``), runs one task per request (so long waits don't block others), expires
stale leases, and never lets one bad message stop it serving everyone else.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio
import zmq
import zmq.asyncio

from refitflow.core.errors import ConfigError, RefitTimeoutError
from refitflow.core.wire import PROTOCOL_VERSION, encode
from refitflow.registry.address import check_address
from refitflow.registry.messages import decode_message, error_reply, identity_from_dict, ok_reply, topic
from refitflow.registry.ops import Handler
from refitflow.registry.security import ServerSecurity
from refitflow.registry.store import RegistryStore

__all__ = ["RegistryServer", "serve"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class RegistryServer:
    address: str  # the bound request endpoint (a ``*`` port resolved)
    pub_address: str  # where announcements are published
    registry: RegistryStore


def _pub_endpoint(address: str) -> str:
    scheme, _, rest = address.partition("://")
    if scheme == "tcp":
        return f"tcp://{rest.rsplit(':', 1)[0]}:*"
    return f"{address}.pub"


@asynccontextmanager
async def serve(
    address: str = "tcp://127.0.0.1:7100",
    *,
    registry: RegistryStore | None = None,
    lease_s: float = 10.0,
    security: ServerSecurity | None = None,
    pub_address: str | None = None,
    max_message_bytes: int = 1 << 28,
    max_in_flight: int = 1024,
) -> AsyncIterator[RegistryServer]:
    """Serve ``registry`` (a new one by default) at ``address`` until the context exits (asyncio only).

    At most ``max_in_flight`` requests are worked on at once (long waits included); a request beyond
    that is answered at once with a ``RefitTimeoutError`` ("busy"), so a flood cannot pile up tasks.
    """
    check_address(address)
    if max_in_flight < 1:
        raise ConfigError(f"max_in_flight must be at least 1, got {max_in_flight}")
    registry = registry or RegistryStore(lease_s=lease_s)
    ctx = zmq.asyncio.Context()
    auth = None
    try:
        if security is not None:
            from zmq.auth import load_certificate
            from zmq.auth.asyncio import AsyncioAuthenticator

            auth = AsyncioAuthenticator(ctx)
            auth.start()
            auth.configure_curve(domain="*", location=str(security.authorized_dir))
            public, secret = load_certificate(str(security.secret_key_file))
        router, pub = ctx.socket(zmq.ROUTER), ctx.socket(zmq.PUB)
        for sock in (router, pub):
            sock.setsockopt(zmq.LINGER, 0)
            if security is not None:
                sock.curve_secretkey, sock.curve_publickey, sock.curve_server = secret, public, True
        router.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        router.setsockopt(zmq.ROUTER_MANDATORY, 0)
        try:
            router.bind(address)
            pub.bind(pub_address or _pub_endpoint(address))
        except zmq.ZMQError as exc:
            raise ConfigError(f"cannot bind the registry at {address}: {exc}") from exc
        server = RegistryServer(
            address=router.getsockopt_string(zmq.LAST_ENDPOINT),
            pub_address=pub.getsockopt_string(zmq.LAST_ENDPOINT),
            registry=registry,
        )
        handler = Handler(registry, hello={"lease_s": registry.lease_s, "pub": server.pub_address,
                                           "protocol": PROTOCOL_VERSION}, announce=_announcer(pub))  # fmt: skip
        # plain tasks, not a task group around the yield: the caller's own errors stay unwrapped
        tasks = [
            asyncio.create_task(_serve_requests(router, handler, max_in_flight)),
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
        ctx.destroy(linger=0)


def _announcer(pub: zmq.asyncio.Socket) -> Any:
    async def announce(identity_dict: dict[str, str], version: int) -> None:
        identity = identity_from_dict(identity_dict)
        await pub.send_multipart([topic(identity), encode({"v": PROTOCOL_VERSION, "identity": identity_dict,
                                                          "version": version})])  # fmt: skip

    return announce


async def _serve_requests(router: zmq.asyncio.Socket, handler: Handler, max_in_flight: int) -> None:
    in_flight = [0]
    async with anyio.create_task_group() as tg:
        while True:
            frames = await router.recv_multipart(copy=True)
            if len(frames) != 2:  # a DEALER sends exactly one frame; anything else is not ours
                log.warning("registry: dropped a message of %d frames", len(frames))
                continue
            busy = in_flight[0] >= max_in_flight
            in_flight[0] += 1
            tg.start_soon(_answer, router, handler, frames[0], frames[1], in_flight, busy)


async def _answer(
    router: zmq.asyncio.Socket, handler: Handler, peer: bytes, frame: bytes, in_flight: list[int], busy: bool
) -> None:
    request_id: Any = None
    try:
        msg = decode_message(frame)
        request_id = msg.get("id")
        if busy:
            raise RefitTimeoutError("registry busy: too many requests in flight, try again")
        reply = ok_reply(request_id, await handler.handle(msg))
    except Exception as exc:  # every failure becomes an error reply; the service keeps serving
        reply = error_reply(request_id, exc)
    finally:
        in_flight[0] -= 1
    try:
        await router.send_multipart([peer, reply])
    except zmq.ZMQError as exc:  # the peer went away: its reply is lost, as on any network
        log.info("registry: reply to a departed peer dropped: %s", exc)


def _log_crash(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("registry: a service task failed", exc_info=task.exception())


async def _expire_leases(registry: RegistryStore) -> None:
    while True:
        await anyio.sleep(registry.lease_s / 4)
        stale = registry.expire()
        if stale:
            log.info("registry: leases expired for %d owner(s)", len(stale))
