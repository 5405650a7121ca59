"""An SGLang server in its own process: SGLang's real HTTP app under uvicorn, refitflow's loader behind it.

``argv[1]``: ``{"tp": 2, "config": dir, "plugins": dir}``. It prints ``RF {"ready": true}`` then
``RF {"url": ...}`` and serves until stdin closes. On a CPU machine (``_sglang_stub``):

- the app is ``sglang.srt.entrypoints.http_server.app`` (its routes, request bodies, answers), served
  without its lifespan (which starts SGLang's tokenizer workers and warm-up);
- SGLang's plugin loader runs first, as SGLang's ``Engine`` does in this process: refitflow's serving-gate
  hooks are applied to SGLang's classes;
- its tokenizer manager is ``CpuTokenizerManager``: SGLang's own ``TokenizerControlMixin`` weight-update
  methods and ``TokenizerManager.pause_generation``/``continue_generation``/``generate_request`` (their
  pause condition and model-update lock; ``generate_request`` is only reached while the gate refuses), with
  the communicators sending each request to every scheduler process
  (``_sglang_rank``, one per TP rank) and answering with TP rank 0's result, as SGLang's do;
- ``GET /test/state?seed=s`` (the tests' own route) reports each rank's model and refitflow state;
  ``POST /test/lose_verdict?rank=r`` loses that rank's next engine-vote verdict.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import socket
import sys
from typing import Any

import anyio
import anyio.to_thread

from tests.integrations._http_child import serve_until_stdin_closes
from tests.integrations._sglang_rank import serve
from tests.integrations._sglang_stub import stub_torchvision

TIMEOUT_S = 300  # one scheduler request (a refit waits for its version and the vote)


def _ask(conn: Any, method: str, arg: Any) -> Any:
    conn.send((method, arg))
    if not conn.poll(TIMEOUT_S):
        raise TimeoutError(f"a scheduler did not answer {method} within {TIMEOUT_S} s")
    kind, value = conn.recv()
    if kind != "ok":
        raise RuntimeError(f"scheduler failed: {value}")
    return value


def tokenizer_manager(ranks: list[Any], args: Any) -> Any:
    from sglang.srt.managers.tokenizer_control_mixin import TokenizerControlMixin
    from sglang.srt.managers.tokenizer_manager import TokenizerManager
    from sglang.srt.utils.aio_rwlock import RWLock

    async def fan_out(method: str, obj: Any) -> list[Any]:
        answers: list[Any] = [None] * len(ranks)

        async def one(i: int) -> None:
            answers[i] = await anyio.to_thread.run_sync(_ask, ranks[i], method, obj)

        async with anyio.create_task_group() as tg:
            for i in range(len(ranks)):
                tg.start_soon(one, i)
        return answers[:1]  # TP rank 0 answers for the server

    class CpuTokenizerManager(TokenizerControlMixin):
        pause_generation = TokenizerManager.pause_generation
        continue_generation = TokenizerManager.continue_generation
        generate_request = TokenizerManager.generate_request  # behind the serving gate: only refusals reach here

        def __init__(self) -> None:
            self.server_args = args
            self.is_pause, self.is_pause_cond, self.model_update_lock = False, asyncio.Condition(), RWLock()
            self.mm_processor, self.weight_version = None, None
            for name in ("begin_weight_update", "end_weight_update", "update_weights_from_tensor"):
                setattr(self, f"{name}_communicator", lambda obj, name=name: fan_out(name, obj))

        def auto_create_handle_loop(self) -> None:  # no detokenizer loop here
            pass

        def abort_request(self, **_: Any) -> None:  # no requests here
            pass

        async def _async_dispatch_to_scheduler(self, obj: Any) -> None:  # nothing to pause in the schedulers
            pass

        def record_config_updates(self, key: str, **values: Any) -> None:
            self.weight_version = values.get("weight_version")

    return CpuTokenizerManager()


async def main() -> None:
    from sglang.srt.entrypoints import http_server
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import ServerArgs

    spec = json.loads(sys.argv[1])
    sys.path.insert(0, spec["plugins"])  # refitflow's entry point, as pip writes it from pyproject.toml
    from sglang.srt.plugins import load_plugins

    load_plugins()  # as SGLang's Engine does in the HTTP server's process: the serving gate's hooks
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        spec["dist_port"] = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    ranks, procs = [], []
    for rank in range(spec["tp"]):
        mine, theirs = ctx.Pipe()
        proc = ctx.Process(target=serve, args=(theirs, rank, spec), daemon=True)
        proc.start()
        ranks.append(mine)
        procs.append(proc)
    for conn in ranks:
        assert conn.poll(240), "a scheduler did not start"
        kind, value = conn.recv()
        assert kind == "ready", value
    args = ServerArgs(model_path=spec["config"], device="cpu", tp_size=spec["tp"], skip_tokenizer_init=True,
                      load_format="dummy")  # fmt: skip
    publish(args, role="tokenizer")
    manager = tokenizer_manager(ranks, args)
    http_server.set_global_state(http_server._GlobalState(tokenizer_manager=manager, template_manager=None,
                                                          scheduler_info={}))  # fmt: skip
    app = http_server.app

    @app.get("/test/state")
    async def state(seed: int | None = None) -> list[Any]:
        return [await anyio.to_thread.run_sync(_ask, conn, "state", seed) for conn in ranks]

    @app.post("/test/lose_verdict")
    async def lose_verdict(rank: int) -> None:
        await anyio.to_thread.run_sync(_ask, ranks[rank], "lose_verdict", None)

    @app.get("/test/weight_version")
    async def weight_version() -> dict[str, Any]:
        return {"weight_version": manager.weight_version, "paused": manager.is_pause}

    await serve_until_stdin_closes(app, lifespan="off")
    for conn in ranks:
        conn.close()
    for proc in procs:
        proc.join(30)


if __name__ == "__main__":
    stub_torchvision()
    asyncio.run(main())
