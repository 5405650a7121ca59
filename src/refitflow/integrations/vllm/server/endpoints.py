"""The ``vllm.endpoint_plugins`` entry point: a readiness route a load balancer polls, and the catch-up of a
server started to join a fleet (``join``).

``GET /refitflow/ready`` answers 200 when the server may take requests — it serves one committed version on
every worker, is not catching up, not fenced, and its last update did not fail — else 503; the body says
which (``rf.EngineState`` as JSON, and each worker's fence, version and what its last refit read:
``pulled_bytes``, of which ``relay_bytes`` from peers). The metric ``refitflow_server_ready`` (1 or 0, in the
server's ``/metrics``) follows every answer and every weight-transfer call. vLLM loads an endpoint plugin
only when ``VLLM_PLUGINS`` names it: ``VLLM_PLUGINS=refitflow``. It also installs the minimum-version contract
(``min_version``: a request below the version it asks for is refused with a retryable 409).
"""

from __future__ import annotations

import logging
from argparse import Namespace
from typing import Any

from refitflow.integrations.hosting.http import READY_ROUTE
from refitflow.integrations.vllm.server import join, plugin
from refitflow.integrations.vllm.server.min_version import MinVersionMiddleware

__all__ = ["Endpoints"]

log = logging.getLogger(__name__)


class Endpoints:
    """vLLM's ``EndpointPlugin`` protocol."""

    name = "refitflow"
    required_tasks = None

    def attach_router(self, app: Any) -> None:
        from fastapi.responses import JSONResponse

        async def ready() -> Any:
            llm = getattr(app.state, "refitflow_engine", None)
            if llm is None:
                return JSONResponse({"ready": False, "state": "gone", "reason": "no engine"}, status_code=503)
            state, workers = await join.readiness(llm)
            body = state.to_dict() | {"caught_up": join.caught_up(llm), "workers": workers}
            return JSONResponse(body, status_code=200 if state.ready else 503)

        app.add_api_route(f"/{READY_ROUTE}", ready, methods=["GET"], include_in_schema=False)

        async def version() -> str | None:
            llm = getattr(app.state, "refitflow_engine", None)
            return None if llm is None else str(await llm.get_weight_version())

        app.add_middleware(MinVersionMiddleware, version=version)

    async def init_state(self, engine_client: Any, state: Any, args: Namespace) -> None:
        plugin.share_vllm_log()  # vLLM's handlers exist by now: the catch-up's lines go to the server's log
        state.refitflow_engine = engine_client
        spec = join.spec_from_env()
        if engine_client is None or spec is None:
            return
        if getattr(getattr(engine_client.vllm_config, "weight_transfer_config", None), "backend", None) != "refitflow":
            log.error("refitflow: %s is set but the server's weight-transfer backend is not refitflow", join.ENV)
            return
        log.info("refitflow: joining the fleet: catching up before serving")
        join.start(engine_client, spec)
