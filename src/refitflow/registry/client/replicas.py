"""A client's way to the replicas of one registry: a ``Channel`` each, and fail-over between them.

A request goes to the replica that answered last. One that does not answer within its share of the
deadline (``NoAnswer``: down, cut off, or stalled) is left for the next, and the request is sent there,
within what is left of the same deadline: every replica but the last gets an equal share of the answer
time (a long poll's server-side ``wait_s`` shrinks to fit its share). Requests are idempotent on the
registry, so one that reached a replica that died before answering may be carried out twice. An answer
the registry gave — a refusal, "busy" — is the answer: it is not asked elsewhere. Replicas of one store
share its incarnation, so moving between them is no restart.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from refitflow.core.errors import ConfigError, RefitTimeoutError
from refitflow.registry.client.channel import Channel, NoAnswer
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
        self.channels = [Channel(a, request_timeout_s=request_timeout_s, security=security, context=context,
                                 on_restart=on_restart) for a in addresses]  # fmt: skip
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

    async def request(self, op: str, timeout: float | None = None, max_bytes: int | None = None, **args: Any) -> Any:
        loop = asyncio.get_running_loop()
        total = self.request_timeout_s if timeout is None else timeout
        deadline, n = loop.time() + total, len(self.channels)
        wait_s = args.get("wait_s")
        last: NoAnswer | None = None
        for attempt in range(n):
            at = (self._at + attempt) % n
            left = deadline - loop.time()
            if left <= 0:
                break
            share = left if attempt == n - 1 else min(left, max(0.0, total - self.request_timeout_s)
                                                       + self.request_timeout_s / (n - attempt))  # fmt: skip
            if isinstance(wait_s, int | float):
                args["wait_s"] = max(0.0, min(float(wait_s), share - self.request_timeout_s / n))
            try:
                result = await self.channels[at].request(op, timeout=share, max_bytes=max_bytes, **args)
            except NoAnswer as exc:
                last = exc
                if n > 1:
                    log.info("registry client: %s did not answer %r; trying %s", self.channels[at].address, op,
                             self.channels[(at + 1) % n].address)  # fmt: skip
                continue
            if at != self._at:
                self._at = at
                if self.on_failover is not None:
                    self.on_failover()
            self.answered_by = self.channels[at]
            return result
        self._at = (self._at + 1) % n if n > 1 else 0
        if last is None:
            raise RefitTimeoutError(f"no registry replica answered {op!r} within {total} s")
        if n == 1:
            raise last
        raise NoAnswer(f"no registry replica answered {op!r} within {total} s (last: {last.reason})")

    async def aclose(self) -> None:
        for channel in self.channels:
            await channel.aclose()
