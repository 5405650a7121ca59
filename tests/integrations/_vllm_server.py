"""A vLLM API server in its own process: vLLM's RL router in a FastAPI app under uvicorn, refitflow behind it.

``argv[1]``: ``{"kind": "qwen2", "tp": 2, "lose_verdict": null}``. It prints ``RF {"ready": true}`` then
``RF {"url": ...}`` and serves until stdin closes. Behind the router:

- one vLLM ``Worker`` per TP rank, running vLLM's own weight-update methods (its session state: start
  refuses an open update, a raise closes it); only the attributes those methods read are set, because
  a real worker needs a GPU to start (``Worker.__new__``, no ``__init__``);
- each worker's engine is built by ``make_engine`` (plugins, ``VllmConfig``, the factory) over a
  ``FusedModel``;
- an engine client in the shape of vLLM's ``AsyncLLM`` for these routes: it fans each call out to
  every worker at once (as ``collective_rpc`` does) and raises the first worker's failure the way vLLM's
  multiprocess executor does (``RuntimeError("Worker failed with error '...'")``); vLLM's own exception
  handlers turn it into the JSON error answer its API server gives; pausing only
  records the state (there is no generation here); checksums are vLLM's own ``compute_tensor_digests``;
- ``lose_verdict``: a worker whose first engine-vote verdict is lost (``LostVerdict``), so it is in doubt.
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace
from typing import Any

import anyio
import anyio.to_thread
import torch

from tests.integrations._http_child import serve_until_stdin_closes
from tests.integrations._vllm_rank import LostVerdict, make_engine


class CpuEngineClient:
    def __init__(self, workers: list[Any], models: list[torch.nn.Module], lose_verdict: int | None = None) -> None:
        self.workers, self.models, self.lose_verdict = workers, models, lose_verdict
        self.paused = False
        self.weight_version: str | None = None

    async def _rpc(self, method: str, *args: Any) -> list[Any]:
        from vllm.v1.worker.gpu_worker import Worker

        results: list[Any] = [None] * len(self.workers)
        errors: list[BaseException] = []

        async def one(i: int) -> None:
            try:
                results[i] = await anyio.to_thread.run_sync(getattr(Worker, method), self.workers[i], *args)
            except Exception as exc:
                errors.append(exc)

        async with anyio.create_task_group() as tg:
            for i in range(len(self.workers)):
                tg.start_soon(one, i)
        if errors:  # as vLLM's MultiprocExecutor.collective_rpc reports a failed worker
            raise RuntimeError(f"Worker failed with error '{errors[0]}', please check the stack trace above "
                               "for the root cause") from errors[0]  # fmt: skip
        return results

    async def pause_generation(self, *, mode: str = "abort", clear_cache: bool = True) -> None:
        self.paused = True

    async def resume_generation(self) -> None:
        self.paused = False

    async def is_paused(self) -> bool:
        return self.paused

    async def init_weight_transfer_engine(self, request: Any) -> None:
        await self._rpc("init_weight_transfer_engine", request.init_info)
        if self.lose_verdict is not None:
            member = self.workers[self.lose_verdict].weight_transfer_engine.session.member
            member.channel = LostVerdict(member.channel)

    async def shutdown_weight_transfer_engine(self) -> None:
        await self._rpc("shutdown_weight_transfer_engine")

    async def start_weight_update(self) -> None:
        await self._rpc("start_weight_update")

    async def update_weights(self, request: Any) -> None:
        await self._rpc("update_weights", request.update_info)

    async def finish_weight_update(self, weight_version: str | None = None) -> None:
        await self._rpc("finish_weight_update")
        if weight_version is not None:
            self.weight_version = weight_version

    async def get_weight_version(self) -> str | None:
        return self.weight_version

    async def compute_weight_checksums(self) -> list[dict[str, str]]:
        from vllm.model_executor.model_loader.weight_checksum import compute_tensor_digests

        return [{f"dp0:pp0:pcp0:tp{r}:{n}": d for n, d in compute_tensor_digests(m).items()}
                for r, m in enumerate(self.models)]  # fmt: skip


def _worker(kind: str, tp: int, rank: int) -> tuple[Any, torch.nn.Module]:
    from vllm.v1.worker.gpu_worker import Worker

    engine, model = make_engine(kind, tp, rank, fill=0.0)  # vLLM zero-fills the vocabulary padding at load
    worker = Worker.__new__(Worker)  # a real worker's __init__ needs a GPU: set what the update methods read
    worker.weight_transfer_engine = engine
    worker.vllm_config = engine.vllm_config
    worker.rank = rank
    worker._weight_update_active = False
    worker._weight_update_is_draft = False
    worker.model_runner = SimpleNamespace(reset_lora_state=lambda: None)
    return worker, model


async def main() -> None:
    from fastapi import FastAPI
    from vllm.entrypoints.rl.online.api_router import router
    from vllm.entrypoints.serve.exception_handling.handlers.exception import exception_handler

    spec = json.loads(sys.argv[1])
    built = [_worker(spec["kind"], spec["tp"], r) for r in range(spec["tp"])]
    app = FastAPI()
    app.include_router(router)
    # vLLM's API server's answer to a raw exception (its init_exception_handler imports watchfiles, not in CI)
    app.exception_handler(Exception)(exception_handler)
    app.state.args = SimpleNamespace(log_error_stack=False)  # the one server argument the handlers read
    app.state.engine_client = CpuEngineClient([w for w, _ in built], [m for _, m in built], spec.get("lose_verdict"))
    await serve_until_stdin_closes(app)
    for worker, _ in built:
        worker.weight_transfer_engine.shutdown()


if __name__ == "__main__":
    anyio.run(main)
