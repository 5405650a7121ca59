"""Staleness as a contract: a generation request may ask for a minimum weight version, and a server that serves an
older one answers at once with a retryable HTTP 409 naming the version it serves (installed by the endpoint plugin,
``endpoints.Endpoints``; vLLM loads it with ``VLLM_PLUGINS=refitflow``).

The request names its minimum in the header ``X-Refitflow-Min-Weight-Version: 5`` or in the JSON body field
``"min_weight_version": 5`` (the header wins). The server compares it with vLLM's own weight-version label (set by
``finish_weight_update``; ``"default"``, the checkpoint the server booted from, counts as 0), and refuses with::

    409 {"error": "...", "served_version": 3, "min_weight_version": 5, "retryable": true}   Retry-After: 1

before vLLM sees the request (nothing is scheduled). A request without either is served as always. A no-drain swap
that lands while an admitted request generates makes that request's later tokens newer, never older: the minimum
holds for every token (vLLM's ``weight_versions`` spans say which). ``fleet_answering`` (``VllmFleet.answering``)
is the fleet-wide view: which servers can answer a given minimum now.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

__all__ = ["FIELD", "HEADER", "MinVersionMiddleware", "refusal", "requested", "served_number"]

HEADER = "X-Refitflow-Min-Weight-Version"
FIELD = "min_weight_version"
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/inference/v1/generate", "/v1/responses")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


def served_number(label: str | None) -> int:
    """vLLM's weight-version label as a number: refitflow labels versions ``"1"``, ``"2"`` ...; the boot
    checkpoint's ``"default"`` (or no label) is 0; another label (set by someone else) is -1: below any minimum."""
    if label is None or label == "default":
        return 0
    try:
        return int(label)
    except ValueError:
        return -1


def requested(header: str | None, body: Any) -> int | None:
    """The minimum a request asks for (header first, then the body field), or None. A value that is not a
    non-negative integer raises ``ValueError`` (the middleware answers 400)."""
    raw = header if header is not None else (body.get(FIELD) if isinstance(body, dict) else None)
    if raw is None:
        return None
    if isinstance(raw, bool) or not str(raw).strip().isdigit():
        raise ValueError(f"{HEADER} / {FIELD} must be a non-negative integer weight version, not {raw!r}")
    return int(str(raw).strip())


def refusal(served: int, minimum: int) -> dict[str, Any]:
    return {"error": f"refitflow: this server serves weight version {served}, below the minimum {minimum} the "
                     "request asks for; retry later or on a server that serves it",
            "served_version": served, "min_weight_version": minimum, "retryable": True}  # fmt: skip


class MinVersionMiddleware:
    """A pure ASGI middleware over vLLM's app: POSTs to the generation routes that name a minimum are checked
    against ``version()`` (vLLM's label, read only for such requests) and refused with 409 when it is older."""

    def __init__(self, app: Any, version: Callable[[], Awaitable[str | None]]) -> None:
        self.app, self.version = app, version

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST" or scope.get("path") not in GENERATION_PATHS:
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        header = headers.get(HEADER.lower())
        chunks: list[bytes] = []
        more = True
        while more:  # the whole body, replayed to vLLM below (vLLM reads it whole anyway)
            message = await receive()
            if message["type"] != "http.request":
                await self.app(scope, _replay([], message, receive), send)
                return
            chunks.append(message.get("body", b""))
            more = bool(message.get("more_body", False))
        raw = b"".join(chunks)
        body: Any = None
        if header is None and FIELD.encode() in raw:
            try:
                body = json.loads(raw)
            except ValueError:
                body = None  # vLLM answers the malformed body itself
        try:
            minimum = requested(header, body)
        except ValueError as exc:
            await _answer(send, 400, {"error": str(exc)})
            return
        if minimum is not None:
            served = served_number(await self.version())
            if served < minimum:
                await _answer(send, 409, refusal(served, minimum), retry_after=True)
                return
        await self.app(scope, _replay([raw], None, receive), send)


def _replay(bodies: list[bytes], pending: Message | None, receive: Receive) -> Receive:
    sent = False

    async def again() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            if pending is not None:
                return pending
            return {"type": "http.request", "body": b"".join(bodies), "more_body": False}
        return await receive()

    return again


async def _answer(send: Send, status: int, body: dict[str, Any], *, retry_after: bool = False) -> None:
    data = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    if retry_after:
        headers.append((b"retry-after", b"1"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})
