"""The test servers' HTTP side (``_vllm_server``, ``_sglang_server``): an app under uvicorn in a child process."""

from __future__ import annotations

import json
import socket
import sys
from typing import Any

import anyio
import anyio.to_thread

PREFIX = "RF "


async def serve_until_stdin_closes(app: Any, **config: Any) -> None:
    """Serve ``app`` on a free local port; print ``RF {"ready": true}`` and ``RF {"url": ...}`` once it
    listens, and stop when the test closes our stdin. ``config``: more ``uvicorn.Config`` options."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    started = anyio.Event()

    class Server(uvicorn.Server):
        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            started.set()

    server = Server(uvicorn.Config(app, log_level="warning", **config))
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: server.serve(sockets=[sock]))
        with anyio.fail_after(60):
            await started.wait()
        print(PREFIX + json.dumps({"ready": True}), flush=True)
        print(PREFIX + json.dumps({"url": f"http://127.0.0.1:{sock.getsockname()[1]}"}), flush=True)
        await anyio.to_thread.run_sync(sys.stdin.read)  # until the test closes our stdin
        server.should_exit = True
