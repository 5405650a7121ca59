"""What the fleet drivers (``vllm.VllmFleet``, ``sglang.SglangFleet``) share: one POST under httpx, and the
error a server's answer becomes. Needs ``httpx`` (in the ``vllm`` and ``sglang`` extras)."""

from __future__ import annotations

from typing import Any

from refitflow.core.errors import RefitError
from refitflow.engine.controller import EngineResult, RankReport

__all__ = ["ServerError", "client", "post", "server_result"]


class ServerError(RefitError):
    """A server's route answered with an error, or not at all (``status`` None: refused or timed out)."""

    def __init__(self, route: str, status: int | None, detail: str) -> None:
        super().__init__(f"{route}: {status or 'no answer'} {detail}")
        self.route, self.status, self.detail = route, status, detail


def client(url: str, timeout_s: float) -> Any:
    """An HTTP client of one server, a connection per request: a server may close a connection after an error
    answer (uvicorn does after a 500), and a reused one would fail the next request."""
    import httpx

    return httpx.AsyncClient(base_url=url, timeout=timeout_s, limits=httpx.Limits(max_keepalive_connections=0))


async def post(http: Any, route: str, body: dict[str, Any] | None, *, params: dict[str, str] | None = None,
               timeout: float | None = None) -> Any:  # fmt: skip
    """POST ``/route``; the JSON answer, or ``ServerError`` (status ≥ 400, or no answer)."""
    import httpx

    try:
        extra = {} if timeout is None else {"timeout": timeout}
        response = await http.post(f"/{route}", json=body, params=params, **extra)
    except httpx.HTTPError as exc:
        raise ServerError(route, None, f"{type(exc).__name__}: {exc}") from exc
    if response.status_code >= 400:
        raise ServerError(route, response.status_code, response.text[:500])
    try:
        return response.json() if response.content else None
    except ValueError as exc:  # an answer that is not JSON (a proxy's error page, a truncated body)
        raise ServerError(route, response.status_code, f"not JSON: {response.text[:200]!r}") from exc


def server_result(name: str, version: int, *, committed: bool, fenced: bool, error: Exception | None) -> EngineResult:
    """One server's outcome as ``rf.Controller`` reports an engine's: one ``RankReport`` for all its ranks (the
    server answers for them together). ``committed``: the update committed; ``error``: the first failure, of
    the update or of a step after it (then the server does not count as committed)."""
    rank = RankReport(
        committed=committed and error is None, decision="commit" if committed else "abort",
        version=version if committed else None, committed_version=version if committed else None,
        fence="fenced" if fenced else "ready", error=None if error is None else str(error),
    )  # fmt: skip
    return EngineResult(engine=name, committed=rank.committed, version=rank.version, ranks=(rank,))
