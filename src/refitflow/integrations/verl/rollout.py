"""The rollout side of the verl backend: each inference server refits itself through refitflow's vLLM backend.

No weights pass through verl's rollout workers. The first rollout worker of each replica drives that
replica's vLLM server (started by verl with ``weight_transfer_config: {backend: refitflow}``), whose
every worker pulls only its own slice from the trainer ranks, verifies it, and the workers commit
together (``integrations/vllm``, ``docs/vllm.md``)::

    init_weight_transfer_engine (once) → start_weight_update → update_weights {"version": v}
        → finish_weight_update → clear the KV cache (it was computed with the old weights)

A failed ``update_weights`` is followed by one ``finish_weight_update`` whose failure is ignored:
when a worker was in doubt its peers learned COMMIT and keep vLLM's update open (as ``VllmFleet``
does over HTTP). The server is reached through a ``VllmServer``: in verl, ``RayVllmServer`` — the
server's Ray actor and its ``collective_rpc``, as verl's own adapter reaches it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any, Protocol

import anyio

from refitflow.core.errors import RefitError, RefitTimeoutError

__all__ = ["RayVllmServer", "VllmServer", "init_server", "refit_server"]


class VllmServer(Protocol):
    """One vLLM server's workers, all at once."""

    async def call(self, method: str, timeout: float, **kwargs: Any) -> Any:
        """Run vLLM's worker method ``method(**kwargs)`` on every worker (``collective_rpc``)."""
        ...

    async def clear_kv_cache(self, timeout: float) -> None: ...


class RayVllmServer:
    """A replica's vLLM server as verl runs it: a named Ray actor with ``collective_rpc`` and ``clear_kv_cache``."""

    def __init__(self, actor: str) -> None:
        self.actor = actor

    def _handle(self) -> Any:
        import ray

        return ray.get_actor(self.actor)

    async def call(self, method: str, timeout: float, **kwargs: Any) -> Any:
        return await self._handle().collective_rpc.remote(method, timeout=timeout, kwargs=kwargs)

    async def clear_kv_cache(self, timeout: float) -> None:
        await self._handle().clear_kv_cache.remote()


async def _call(
    server: VllmServer, method: str, timeout: float, slack: float, version: int | None, **kwargs: Any
) -> None:
    """``method`` on every worker of ``server`` under ``timeout`` (+ ``slack`` for the call itself);
    ``clear_kv_cache``: the server's own method."""
    try:
        with anyio.fail_after(timeout + slack):
            if method == "clear_kv_cache":
                await server.clear_kv_cache(timeout)
            else:
                await server.call(method, timeout, **kwargs)
    except TimeoutError as exc:
        raise RefitTimeoutError(f"vLLM's {method} did not answer within {timeout} s", version=version) from exc
    except RefitError:
        raise
    except Exception as exc:  # Ray wraps the worker's error: keep its words
        raise RefitError(f"vLLM's {method} failed: {exc}", version=version) from exc


async def init_server(server: VllmServer, init_info: Mapping[str, Any], *, timeout_s: float) -> None:
    """Initialise the server's refitflow backend (once per server: a second init is refused there). If it
    fails, the workers that did initialise are shut down again, so that the next sync's init is not refused."""
    try:
        await _call(server, "init_weight_transfer_engine", timeout_s, timeout_s, None, init_info=dict(init_info))
    except RefitError:
        with contextlib.suppress(RefitError):
            await _call(server, "shutdown_weight_transfer_engine", timeout_s, timeout_s, None)
        raise


async def refit_server(server: VllmServer, version: int, *, timeout_s: float, vote_timeout_s: float,
                       request_timeout_s: float) -> None:  # fmt: skip
    """Bring one server to ``version`` (or newer). A worker's update may take ``timeout_s`` and then its
    vote ``vote_timeout_s``: vLLM is given both, so it never gives up on workers still deciding."""
    slack = request_timeout_s
    await _call(server, "start_weight_update", request_timeout_s, slack, version)
    try:
        update = {"version": version, "timeout_s": timeout_s}
        await _call(server, "update_weights", timeout_s + vote_timeout_s, slack, version, update_info=update)
    except RefitError:
        with contextlib.suppress(RefitError):  # the workers that learned COMMIT beside a peer in doubt
            await _call(server, "finish_weight_update", request_timeout_s, slack, version)
        raise
    await _call(server, "finish_weight_update", request_timeout_s, slack, version)
    await _call(server, "clear_kv_cache", request_timeout_s, slack, version)
