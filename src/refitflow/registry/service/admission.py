"""Which requests the registry service works on: size, requests in flight (in all, per client, in bytes),
and whether a request is stale (its client gave up on it) or comes from a client of an earlier
incarnation of the registry (the registry restarted).

Refusals are typed: an oversize frame is a ``ManifestError``, a full house a ``RefitTimeoutError``
("busy", try again), a stale request a ``RefitTimeoutError`` (its answer would be dropped anyway: it
is not carried out, so an abandoned request never takes effect after its client moved on).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

import orjson

from refitflow.core.errors import ManifestError, RefitError, RefitTimeoutError
from refitflow.registry.limits import RegistryLimits

__all__ = ["Gate", "check_fresh", "request_id_of"]

# how every client encodes a request: the id comes right after the protocol version (orjson keeps key order)
_ID_PREFIX = re.compile(rb'\{"v":[^,]{1,20},"id":(-?\d{1,20}|"[^"\\]{0,64}")')


def request_id_of(frame: bytes) -> Any:
    """The id of a request refused before it is decoded (from its first bytes), or None."""
    found = _ID_PREFIX.match(frame)
    return None if found is None else orjson.loads(found.group(1))


class Gate:
    """Counts the requests being worked on; ``admit`` refuses one that would pass a limit."""

    def __init__(self, limits: RegistryLimits) -> None:
        self._limits = limits
        self._count = 0
        self._bytes = 0
        self._per_client: dict[bytes, int] = {}
        self._per_host: dict[bytes, int] = {}

    def admit(self, client: bytes, host: bytes, nbytes: int) -> RefitError | None:
        """None and counted (call ``done`` later), or the error to answer at once."""
        limits = self._limits
        if nbytes > limits.max_message_bytes:
            return ManifestError(f"a request of {nbytes} bytes is over the registry's limit of "
                                 f"{limits.max_message_bytes} bytes")  # fmt: skip
        held = self._per_client.get(client, 0)
        if held >= limits.max_in_flight_per_client:
            return RefitTimeoutError(f"registry busy: this client has {held} requests in flight, try again")
        on_host = self._per_host.get(host, 0)
        if on_host >= limits.per_host:
            return RefitTimeoutError(f"registry busy: this client's host has {on_host} requests in flight, try again")
        if self._count >= limits.max_in_flight or self._bytes + nbytes > limits.max_in_flight_bytes:
            return RefitTimeoutError("registry busy: too many requests in flight, try again")
        self._count += 1
        self._bytes += nbytes
        self._per_client[client] = held + 1
        self._per_host[host] = on_host + 1
        return None

    def done(self, client: bytes, host: bytes, nbytes: int) -> None:
        self._count -= 1
        self._bytes -= nbytes
        for counts, key in ((self._per_client, client), (self._per_host, host)):
            left = counts[key] - 1
            if left:
                counts[key] = left
            else:
                del counts[key]


def check_fresh(msg: dict[str, Any], incarnation: str, on_returning: Callable[[], None]) -> None:
    """Refuse a request whose ``deadline`` (on this registry's clock, for this incarnation) has passed;
    call ``on_returning`` for a request naming an earlier incarnation (a client from before a restart)."""
    inc, deadline = msg.get("inc"), msg.get("deadline")
    if inc is not None and not isinstance(inc, str):
        raise ManifestError(f"request field 'inc' must be a string, got {type(inc).__name__}")
    if deadline is not None and (isinstance(deadline, bool) or not isinstance(deadline, int | float)):
        raise ManifestError(f"request field 'deadline' must be a number, got {type(deadline).__name__}")
    if inc is None:
        return
    if inc != incarnation:
        on_returning()
    elif deadline is not None and time.monotonic() > deadline:
        raise RefitTimeoutError("stale request: its client stopped waiting for it before it arrived; not carried out")
