"""The minimum-version contract's middleware (``integrations/vllm/server/min_version.py``) over a plain ASGI app
standing in for vLLM's (the real server is in ``test_trl_grpo.py``): what it refuses, what it passes through
untouched."""

from __future__ import annotations

import json
from typing import Any

import anyio
import httpx
import pytest

from refitflow.integrations.vllm.server.min_version import FIELD, HEADER, MinVersionMiddleware, requested, served_number


class Echo:
    """vLLM's app stand-in: answers 200 with the body it read."""

    def __init__(self) -> None:
        self.seen: list[bytes] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        body, more = b"", True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        self.seen.append(body)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": body})


def client(label: str | None) -> tuple[httpx.AsyncClient, Echo]:
    app = Echo()

    async def version() -> str | None:
        return label

    transport = httpx.ASGITransport(app=MinVersionMiddleware(app, version=version))
    return httpx.AsyncClient(transport=transport, base_url="http://server"), app


def test_labels_and_minimums_parse_as_the_contract_says() -> None:
    assert [served_number(x) for x in (None, "default", "0", "7", "v7")] == [0, 0, 0, 7, -1]
    assert requested(None, None) is None and requested(None, {"prompt": [1]}) is None
    assert requested("5", {FIELD: 9}) == 5  # the header wins
    assert requested(None, {FIELD: 9}) == 9 and requested(" 3 ", None) == 3
    for bad in ("latest", "-1", "1.5"):
        with pytest.raises(ValueError, match="non-negative integer"):
            requested(bad, None)
    with pytest.raises(ValueError):
        requested(None, {FIELD: True})


@pytest.mark.asyncio
async def test_a_request_above_the_served_version_is_refused_at_once_and_others_pass_untouched() -> None:
    with anyio.fail_after(30):
        http, app = client("4")
        async with http:
            refused = await http.post("/v1/completions", json={"prompt": [1]}, headers={HEADER: "5"})
            assert refused.status_code == 409 and refused.headers["retry-after"] == "1"
            assert refused.json() | {"error": ""} == {"error": "", "served_version": 4, "min_weight_version": 5,
                                                      "retryable": True}  # fmt: skip
            in_body = await http.post("/v1/chat/completions", json={"messages": [], FIELD: 6})
            assert in_body.status_code == 409 and in_body.json()["min_weight_version"] == 6
            assert app.seen == []  # vLLM never saw either

            body = {"token_ids": [1, 2], FIELD: 4}
            served = await http.post("/inference/v1/generate", json=body)
            assert served.status_code == 200 and json.loads(served.content) == body  # the body reached vLLM whole
            plain = await http.post("/v1/completions", content=b"not json at all")  # vLLM answers that itself
            assert plain.status_code == 200 and plain.content == b"not json at all"
            other = await http.post("/update_weights", json={FIELD: 99}, headers={HEADER: "99"})
            assert other.status_code == 200  # only the generation routes are checked
            bad = await http.post("/v1/completions", json={}, headers={HEADER: "latest"})
            assert bad.status_code == 400 and "non-negative integer" in bad.json()["error"]
        http, _ = client("default")  # the boot checkpoint: version 0
        async with http:
            assert (await http.post("/v1/completions", json={}, headers={HEADER: "0"})).status_code == 200
            assert (await http.post("/v1/completions", json={}, headers={HEADER: "1"})).status_code == 409
