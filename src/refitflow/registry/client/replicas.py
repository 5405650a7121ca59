"""A client's way to the replicas of one registry: a ``Channel`` each, and fail-over between them.

A request goes to the replica that answered last (the *current* one), unless its connection is known to
be broken: replicas with a live connection come first, then those not tried yet, then those where nobody
listened last. One that does not answer within its share of the deadline (``NoAnswer``: down, cut off, or
stalled) is left for the next, and the request is sent there, within what is left of the same deadline:
every replica but the last gets an equal share of the answer time (a long poll's server-side ``wait_s``
shrinks to fit its share). A replica whose connection breaks while it holds the request (``Lost``: its
process died), or where nobody listens (``Unsent``: the request could not even be sent), is left at once,
not at the end of its share; once every replica has had its turn and time is left (every one of them
failed fast), the round starts again. Each request fixes its own order when it starts, and a failure moves
the current replica on only if it is still the one that failed: requests failing at once never send each
other back to a dead replica.

Requests are idempotent on the registry, so one that reached a replica that died before answering may be
carried out twice. An answer the registry gave — a refusal, "busy" — is the answer: it is not asked
elsewhere. Replicas of one store share its incarnation, so moving between them is no restart.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from refitflow.core.errors import ConfigError, RefitTimeoutError
from refitflow.registry.client.channel import Channel, Lost, NoAnswer, Seen, Unsent
from refitflow.registry.security import ClientSecurity

__all__ = ["Replicas"]

log = logging.getLogger(__name__)


class Replicas:
    def __init__(
        self,
        addresses: list[str],
        *,
        request_timeout_s: float,
        security: ClientSecurity | None,
        context: zmq.asyncio.Context | None,
        on_restart: Callable[[], None] | None = None,
    ) -> None:
        if not addresses:
            raise ConfigError("a registry client needs at least one address")
        self.request_timeout_s = request_timeout_s
        self.seen = Seen()  # one incarnation for every replica: a replica of a new store is a restart too
        self.channels = [Channel(a, request_timeout_s=request_timeout_s, security=security, context=context,
                                 on_restart=on_restart, seen=self.seen) for a in addresses]  # fmt: skip
        self._at = 0
        self.answered_by = self.channels[0]  # the replica that answered the latest request
        self.on_failover: Callable[[], None] | None = None

    @property
    def current(self) -> Channel:
        return self.channels[self._at]

    @property
    def answering(self) -> bool:
        return self.current.answering

    @property
    def closed(self) -> bool:
        return self.channels[0].closed

    def order(self) -> list[int]:
        """The replicas in the order a request tries them: from the current one round, those with a live connection
        first, then those not tried yet, then those where nobody listened last."""
        n = len(self.channels)
        ring = [(self._at + k) % n for k in range(n)]
        rank = {True: 0, None: 1, False: 2}
        return sorted(ring, key=lambda i: rank[self.channels[i].up])  # stable: the ring's order within each

    def _leave(self, at: int) -> None:
        """Replica ``at`` did not answer: if it is still the current one, the next in line is (not otherwise:
        another request may have moved on already, and must not be sent back)."""
        if at == self._at and len(self.channels) > 1:
            self._at = next(i for i in self.order() if i != at)

    async def request(self, op: str, timeout: float | None = None, max_bytes: int | None = None, **args: Any) -> Any:
        loop = asyncio.get_running_loop()
        total = self.request_timeout_s if timeout is None else timeout
        deadline, n = loop.time() + total, len(self.channels)
        wait_s = args.get("wait_s")
        last: NoAnswer | None = None
        order, attempt = self.order(), 0
        while (left := deadline - loop.time()) > 0:
            k = attempt % n
            if attempt and k == 0:  # every replica failed fast (broken connections): a new round, after a breath
                await asyncio.sleep(min(0.05, left))
                order, left = self.order(), deadline - loop.time()
                if left <= 0:
                    break
            at = order[k]
            share = left if k == n - 1 else min(left, max(0.0, total - self.request_timeout_s)
                                                 + self.request_timeout_s / (n - k))  # fmt: skip
            if isinstance(wait_s, int | float):
                args["wait_s"] = max(0.0, min(float(wait_s), share - self.request_timeout_s / n))
            attempt += 1
            try:
                result = await self.channels[at].request(op, timeout=share, max_bytes=max_bytes, **args)
            except NoAnswer as exc:
                last = exc
                self._leave(at)
                if n > 1:
                    why = "lost its connection with" if isinstance(exc, Lost) else "did not answer"
                    why = "has nobody listening for" if isinstance(exc, Unsent) else why
                    log.info("registry client: %s %s %r; trying %s", self.channels[at].address, why, op,
                             self.channels[order[(k + 1) % n]].address)  # fmt: skip
                continue
            if at != self._at:
                self._at = at
                if self.on_failover is not None:
                    self.on_failover()
            self.answered_by = self.channels[at]
            return result
        if last is None:
            raise RefitTimeoutError(f"no registry replica answered {op!r} within {total} s")
        if n == 1:
            raise last
        raise NoAnswer(f"no registry replica answered {op!r} within {total} s (last: {last.reason})")

    async def aclose(self) -> None:
        for channel in self.channels:
            await channel.aclose()
