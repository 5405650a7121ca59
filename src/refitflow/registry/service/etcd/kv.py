"""etcd's v3 API over gRPC, with fail-over between the members of a cluster.

One ``grpc.aio`` channel per member endpoint; the stubs and messages are aetcd's (``aetcd.rpc``: the
maintained asyncio client, whose generated v3 stubs we use directly, because its ``Client`` speaks to one
endpoint and does not expose ``ignore_lease`` or the ``hasleader`` watch option). Every call has a deadline
(``call_timeout_s``); a member that does not answer in time, refuses (``UNAVAILABLE``) or has no leader is
left for the next one, and the call tried there, until ``op_timeout_s`` has passed: then
``RefitTimeoutError``. Every request carries ``hasleader``: a member cut off from the majority answers
"no leader" at once instead of serving stale reads (reads are linearizable, etcd's default) or holding a
watch that will never fire.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import grpc.aio
from aetcd import rpc

from refitflow.core.errors import ConfigError, RefitTimeoutError, TransportError
from refitflow.registry.service.etcd.keys import EtcdTLS

__all__ = [
    "KV",
    "META",
    "Etcd",
    "RevisionCompacted",
    "delete",
    "exists",
    "get",
    "missing",
    "mod_is",
    "prefix_end",
    "put",
    "value_is",
]

log = logging.getLogger(__name__)

T = TypeVar("T")
_RETRY = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
          grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}  # fmt: skip
META = (("hasleader", "true"),)


def prefix_end(prefix: bytes) -> bytes:
    """The end of the key range holding every key that starts with ``prefix``."""
    end = bytearray(prefix)
    while end and end[-1] == 0xFF:
        end.pop()
    if not end:
        return b"\0"
    end[-1] += 1
    return bytes(end)


@dataclass(frozen=True)
class KV:
    key: bytes
    value: bytes
    mod_revision: int
    create_revision: int
    lease: int

    @classmethod
    def of(cls, kv: Any) -> KV:
        return cls(kv.key, kv.value, kv.mod_revision, kv.create_revision, kv.lease)


class Etcd:
    """A cluster's members; ``call`` runs one RPC on the member that answered last, failing over."""

    def __init__(self, endpoints: Sequence[str], *, call_timeout_s: float = 1.0, op_timeout_s: float = 4.0,
                 tls: EtcdTLS | None = None) -> None:  # fmt: skip
        if not endpoints:
            raise ConfigError("an etcd cluster needs at least one endpoint")
        self.endpoints = list(endpoints)
        self.call_timeout_s, self.op_timeout_s = call_timeout_s, op_timeout_s
        if tls is None:
            self._channels = [grpc.aio.insecure_channel(e) for e in self.endpoints]
        else:
            creds = grpc.ssl_channel_credentials(
                root_certificates=tls.ca_file.read_bytes(),
                private_key=None if tls.key_file is None else tls.key_file.read_bytes(),
                certificate_chain=None if tls.cert_file is None else tls.cert_file.read_bytes(),
            )
            self._channels = [grpc.aio.secure_channel(e, creds) for e in self.endpoints]
        self._at = 0

    async def aclose(self) -> None:
        for channel in self._channels:
            await channel.close()

    @property
    def current(self) -> str:
        return self.endpoints[self._at]

    def skip(self) -> None:
        """Leave the member in use for the next one (its watch went quiet, say)."""
        self._at = (self._at + 1) % len(self._channels)

    async def call(self, what: str, fn: Callable[[grpc.aio.Channel], Any], timeout: float | None = None,
                   patient: bool = False) -> Any:  # fmt: skip
        """``await fn(channel)`` on one member after another until one answers, within ``timeout``; ``patient``:
        a large read, given the whole of it on each member rather than ``call_timeout_s``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (self.op_timeout_s if timeout is None else timeout)
        last: BaseException | None = None
        while (left := deadline - loop.time()) > 0:
            at = self._at
            try:
                limit = left if patient else min(left, self.call_timeout_s)
                return await asyncio.wait_for(fn(self._channels[at]), limit)
            except TimeoutError as exc:
                last = exc
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in _RETRY and "no leader" not in (exc.details() or ""):
                    raise TransportError(f"etcd {self.endpoints[at]}: {what}: {exc.code().name}: "
                                         f"{exc.details()}") from exc  # fmt: skip
                last = exc
                await asyncio.sleep(min(0.05, max(0.0, deadline - loop.time())))
            if self._at == at:
                self._at = (at + 1) % len(self._channels)
                log.info("etcd: %s: %s did not answer (%s); trying %s", what, self.endpoints[at],
                         _why(last), self.current)  # fmt: skip
        raise RefitTimeoutError(f"etcd ({', '.join(self.endpoints)}) did not answer {what} "
                                f"within {timeout or self.op_timeout_s} s: {_why(last)}")  # fmt: skip

    # -- KV ---------------------------------------------------------------------------------------

    async def get_prefix(self, prefix: bytes, *, revision: int = 0) -> tuple[int, list[KV]]:
        """Every key under ``prefix``, in key order, as of ``revision`` (0: now); and the revision read at. Patient:
        a manifest's chunks are megabytes (one of 4 MB took over a second on a loaded machine)."""
        req = rpc.RangeRequest(key=prefix, range_end=prefix_end(prefix), revision=revision)
        resp = await self.call("range", lambda ch: rpc.KVStub(ch).Range(req, metadata=META), patient=True)
        return resp.header.revision, [KV.of(kv) for kv in resp.kvs]

    async def revision(self) -> int:
        """The cluster's current revision (a linearizable read)."""
        req = rpc.RangeRequest(key=b"\0", count_only=True)
        resp = await self.call("revision", lambda ch: rpc.KVStub(ch).Range(req, metadata=META))
        return int(resp.header.revision)

    async def txn(self, compare: list[Any], success: list[Any], failure: Sequence[Any] = ()) -> tuple[bool, int, Any]:
        """One transaction: (succeeded, its revision, its responses)."""
        req = rpc.TxnRequest(compare=compare, success=success, failure=list(failure))
        resp = await self.call("txn", lambda ch: rpc.KVStub(ch).Txn(req, metadata=META))
        return bool(resp.succeeded), int(resp.header.revision), resp.responses

    async def delete_prefix(self, prefix: bytes) -> int:
        req = rpc.DeleteRangeRequest(key=prefix, range_end=prefix_end(prefix))
        resp = await self.call("delete", lambda ch: rpc.KVStub(ch).DeleteRange(req, metadata=META))
        return int(resp.header.revision)

    # -- leases -------------------------------------------------------------------------------------

    async def grant(self, ttl_s: int) -> int:
        req = rpc.LeaseGrantRequest(TTL=ttl_s)
        resp = await self.call("lease grant", lambda ch: rpc.LeaseStub(ch).LeaseGrant(req, metadata=META))
        return int(resp.ID)

    async def keepalive(self, lease: int) -> bool:
        """Refresh ``lease``; False when etcd no longer has it (expired or revoked)."""

        async def once(ch: grpc.aio.Channel) -> int:
            async def requests() -> AsyncIterator[Any]:
                yield rpc.LeaseKeepAliveRequest(ID=lease)

            call = rpc.LeaseStub(ch).LeaseKeepAlive(requests(), metadata=META)
            try:
                async for resp in call:
                    return int(resp.TTL)
                return 0
            finally:
                call.cancel()

        return bool(await self.call("lease keep-alive", once) > 0)

    async def revoke(self, lease: int) -> None:
        req = rpc.LeaseRevokeRequest(ID=lease)
        try:
            await self.call("lease revoke", lambda ch: rpc.LeaseStub(ch).LeaseRevoke(req, metadata=META))
        except TransportError as exc:  # NOT_FOUND: gone already
            log.info("etcd: revoking lease %x: %s", lease, exc)

    # -- watch --------------------------------------------------------------------------------------

    async def watch(self, prefix: bytes, start_revision: int, progress: asyncio.Queue[None]
                    ) -> AsyncIterator[tuple[int, list[Any]]]:  # fmt: skip
        """(revision, events) for every change under ``prefix`` from ``start_revision`` on, from the member in
        use; each item put in ``progress`` asks the member for a progress answer (no events: every event up to
        that revision was delivered). Ends with ``TransportError`` when that member fails or loses its leader
        (watch again, elsewhere); ``RevisionCompacted`` when ``start_revision`` is gone (reload)."""
        create = rpc.WatchRequest(create_request=rpc.WatchCreateRequest(
            key=prefix, range_end=prefix_end(prefix), start_revision=start_revision))  # fmt: skip

        async def requests() -> AsyncIterator[Any]:
            yield create
            while True:
                await progress.get()
                yield rpc.WatchRequest(progress_request=rpc.WatchProgressRequest())

        endpoint = self.current
        call = rpc.WatchStub(self._channels[self._at]).Watch(requests(), metadata=META)
        try:
            async for resp in call:
                if resp.compact_revision:
                    raise RevisionCompacted(int(resp.compact_revision))
                if resp.canceled:
                    raise TransportError(f"etcd {endpoint}: watch canceled: {resp.cancel_reason}")
                yield int(resp.header.revision), list(resp.events)
        except grpc.aio.AioRpcError as exc:
            raise TransportError(f"etcd {endpoint}: watch: {exc.code().name}: {exc.details()}") from exc
        finally:
            call.cancel()
        raise TransportError(f"etcd {endpoint}: the watch stream ended")


class RevisionCompacted(TransportError):
    def __init__(self, revision: int) -> None:
        super().__init__(f"etcd compacted the watched history up to revision {revision}")
        self.revision = revision


def _why(exc: BaseException | None) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return "no answer in time" if isinstance(exc, TimeoutError) or exc is None else str(exc)


# -- request builders ---------------------------------------------------------------------------------


def put(key: bytes, value: bytes, lease: int = 0, *, ignore_lease: bool = False) -> Any:
    return rpc.RequestOp(request_put=rpc.PutRequest(key=key, value=value, lease=lease, ignore_lease=ignore_lease))


def delete(key: bytes, *, prefix: bool = False) -> Any:
    end = prefix_end(key) if prefix else b""
    return rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=key, range_end=end))


def get(key: bytes) -> Any:
    return rpc.RequestOp(request_range=rpc.RangeRequest(key=key))


def mod_is(key: bytes, revision: int) -> Any:
    """The key was last changed at ``revision`` (0: it does not exist)."""
    return rpc.Compare(key=key, target=rpc.Compare.MOD, result=rpc.Compare.EQUAL, mod_revision=revision)


def value_is(key: bytes, value: bytes) -> Any:
    return rpc.Compare(key=key, target=rpc.Compare.VALUE, result=rpc.Compare.EQUAL, value=value)


def exists(key: bytes) -> Any:
    return rpc.Compare(key=key, target=rpc.Compare.CREATE, result=rpc.Compare.GREATER, create_revision=0)


def missing(key: bytes) -> Any:
    return rpc.Compare(key=key, target=rpc.Compare.CREATE, result=rpc.Compare.EQUAL, create_revision=0)


PUT, DELETE = rpc.Event.PUT, rpc.Event.DELETE
