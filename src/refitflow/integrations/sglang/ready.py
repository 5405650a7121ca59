"""SGLang's readiness route: ``GET /refitflow/ready`` on the server's own HTTP app, added by the plugin in the
HTTP server's process. 200 when the server may take requests (a version committed on every rank, not
catching up, not behind), else 503; the body is the server's ``rf.EngineState`` as JSON. The gauge
``refitflow_server_ready`` (1 or 0) follows every answer."""

from __future__ import annotations

import sys
from typing import Any

from refitflow.engine.readiness import EngineState, gated
from refitflow.integrations.hosting.http import READY_ROUTE, set_ready
from refitflow.integrations.sglang import gate

__all__ = ["attach", "state_of"]

_HTTP = "sglang.srt.entrypoints.http_server"


def state_of(manager: Any) -> EngineState:
    """The server's state, from its tokenizer manager's gate."""
    name = "this server"
    label = getattr(manager, "weight_version", None) or getattr(getattr(manager, "server_args", None),
                                                                 "weight_version", None)  # fmt: skip
    version = int(label) if isinstance(label, str) and label.isdigit() else None
    joining = gate.joining(manager)
    verdict = gated(name, None if joining else version, fenced=gate.closed(manager), joining=joining,
                    behind=gate.behind(manager))  # fmt: skip
    return verdict or EngineState(engine=name, state="current", version=version)


def attach() -> None:
    """Add the route to SGLang's app, in the HTTP server's process only (where SGLang imported it)."""
    http_server = sys.modules.get(_HTTP)
    if http_server is None or any(getattr(r, "path", None) == f"/{READY_ROUTE}" for r in http_server.app.routes):
        return
    from fastapi.responses import JSONResponse

    async def ready() -> Any:
        state = state_of(http_server.get_global_state().tokenizer_manager)
        set_ready(state.ready)
        return JSONResponse(state.to_dict(), status_code=200 if state.ready else 503)

    http_server.app.add_api_route(f"/{READY_ROUTE}", ready, methods=["GET"], include_in_schema=False)
