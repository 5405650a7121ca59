"""What the fleet drivers (``vllm.VllmFleet``, ``sglang.SglangFleet``) share: one POST under httpx, the
error a server's answer becomes, the servers by name, and how a server's update ends (fenced and left
paused, or resumed). Needs ``httpx`` (in the ``vllm`` and ``sglang`` extras)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

import anyio

from refitflow.core.errors import ConfigError, RefitError
from refitflow.engine.controller import EngineResult, RankReport
from refitflow.engine.readiness import STATES, EngineState, against

__all__ = ["READY_ROUTE", "ServerError", "client", "each_server", "named_servers", "post", "ready_answer",
           "ready_state", "server_result", "set_ready", "settle", "step"]  # fmt: skip

T = TypeVar("T")
READY_ROUTE = "refitflow/ready"  # every integration's readiness route (GET: 200 current, 503 otherwise)
_GAUGE: list[Any] = []


def set_ready(ready: bool) -> None:
    """The server's ``refitflow_server_ready`` gauge (1 or 0) in its process's default Prometheus registry (the
    one vLLM's and SGLang's ``/metrics`` export)."""
    if not _GAUGE:
        from prometheus_client import Gauge

        _GAUGE.append(Gauge("refitflow_server_ready", "1 when this server may take requests, else 0 (refitflow's "
                            "readiness: not catching up, fenced or behind)"))  # fmt: skip
    _GAUGE[0].set(1 if ready else 0)


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
        raise ServerError(route, response.status_code, response.text[:2000])  # every rank's error, the last ones too
    try:
        return response.json() if response.content else None
    except ValueError as exc:  # an answer that is not JSON (a proxy's error page, a truncated body)
        kind = response.headers.get("content-type", "")
        if "json" not in kind and "html" not in kind:
            return response.text  # not meant as JSON (vLLM's LoRA routes answer a bare sentence)
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


def named_servers(servers: Mapping[str, str] | Sequence[str]) -> dict[str, str]:
    """Server name -> base URL (a list of URLs names each server by its URL)."""
    named = dict(servers) if isinstance(servers, Mapping) else {url: url for url in servers}
    if not named:
        raise ConfigError("a fleet needs at least one server URL")
    return {name: url.rstrip("/") for name, url in named.items()}


async def each_server(servers: Mapping[str, str], one: Callable[[str, str], Awaitable[T]]) -> dict[str, T]:
    """``one(name, url)`` on every server at once; the results by name."""
    results: dict[str, T] = {}

    async def run(name: str, url: str) -> None:
        results[name] = await one(name, url)

    async with anyio.create_task_group() as tg:
        for name, url in servers.items():
            tg.start_soon(run, name, url)
    return results


async def step(http: Any, route: str, body: dict[str, Any] | None, timeout_s: float) -> ServerError | None:
    """POST ``route`` under ``timeout_s``, shielded from cancellation (a closing step must be sent); its
    error, if any."""
    try:
        with anyio.CancelScope(shield=True), anyio.fail_after(timeout_s):
            await post(http, route, body)
    except ServerError as exc:
        return exc
    except TimeoutError:
        return ServerError(route, None, f"no answer within {timeout_s} s")
    return None


async def settle(http: Any, name: str, version: int, *, committed: bool, wrote: bool, in_place: bool,
                 error: ServerError | None, paused: set[str], resume: tuple[str, dict[str, Any] | None] | None,
                 timeout_s: float) -> EngineResult:  # fmt: skip
    """How a server's update ends. Fenced — left paused (in ``paused``) — when it failed after it may have
    written (``wrote``): in place, or in doubt in either mode (some ranks may have committed, others not);
    else resumed with ``resume`` (route, body; None: it was never paused)."""
    fenced = not committed and wrote and (in_place or "in doubt" in str(error))
    if fenced:
        paused.add(name)
    elif resume is not None:
        failed = await step(http, *resume, timeout_s)
        if failed is None:
            paused.discard(name)
        error = error or failed
    return server_result(name, version, committed=committed, fenced=fenced, error=error)


async def ready_state(name: str, url: str, *, target: int | None, timeout_s: float) -> EngineState:
    """Server ``name``'s readiness route, as an ``rf.EngineState``; short of the fleet's version ``target`` a
    server that calls itself current is behind; no answer: gone."""
    return (await ready_answer(name, url, target=target, timeout_s=timeout_s))[0]


async def ready_answer(name: str, url: str, *, target: int | None,
                       timeout_s: float) -> tuple[EngineState, dict[str, Any]]:  # fmt: skip
    """``ready_state`` and the route's whole body (empty when there was none)."""
    import httpx

    async with client(url, timeout_s) as http:
        try:
            response = await http.get(f"/{READY_ROUTE}")
            body = response.json() if response.status_code in (200, 503) else None
        except (httpx.HTTPError, ValueError) as exc:
            return EngineState(engine=name, state="gone", version=None, reason=f"{type(exc).__name__}: {exc}"), {}
    if not isinstance(body, dict) or body.get("state") not in STATES:
        reason = f"no readiness answer at /{READY_ROUTE} ({response.status_code})"
        return EngineState(engine=name, state="gone", version=None, reason=reason), {}
    version = body.get("version") if type(body.get("version")) is int else None
    state = EngineState(engine=name, state=body["state"], version=version, reason=body.get("reason"))
    return against(state, target), body
