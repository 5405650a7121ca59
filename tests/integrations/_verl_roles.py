"""The processes of the verl backend test: actor ranks and a rollout worker, each with the backend made the
way verl makes it (``import_external_libs(custom_backend_module)``, then ``CheckpointEngineRegistry.new``).

Each role takes commands on its inbox and answers ``(role, command, value)`` on the shared outbox; the test
plays verl's ``CheckpointEngineManager`` (prepare → build_topology → init_process_group → send/receive →
finalize). The rollout worker's vLLM server is a stand-in (below) over refitflow's real vLLM backend.
"""

from __future__ import annotations

import functools
import os
import traceback
from typing import Any

import anyio
import anyio.to_thread
import torch

MODEL = "qwen2"
KWARGS = {
    "model": "tiny-verl",
    "vllm": {"budget_bytes": 1 << 16, "vote_timeout_s": 20},
    "update_timeout_s": 120.0,
    "release_timeout_s": 120.0,
}


class WorkerStandIn:
    """One vLLM worker's weight-transfer methods, called as vLLM's ``Worker`` calls them (``gpu_worker.py``:
    parse the init info, then the engine's hooks). A mock of Ray and of verl's vLLM server only: neither can
    run here; the backend underneath is refitflow's real vLLM backend (``make_engine``) over a FusedModel."""

    def __init__(self, engine: Any) -> None:
        self.engine, self.calls = engine, []

    async def call(self, method: str, timeout: float, **kwargs: Any) -> Any:
        self.calls.append(method)
        e = self.engine
        hooks = {
            "init_weight_transfer_engine": lambda init_info: e.init_transfer_engine(e.parse_init_info(init_info)),
            "start_weight_update": e.start_weight_update,
            "update_weights": e.update_weights,
            "finish_weight_update": e.finish_weight_update,
            "shutdown_weight_transfer_engine": e.shutdown,
        }
        with anyio.fail_after(timeout):
            return await anyio.to_thread.run_sync(functools.partial(hooks[method], **kwargs))

    async def clear_kv_cache(self, timeout: float) -> None:
        self.calls.append("clear_kv_cache")


def make_backend(**extra: Any) -> Any:
    from verl.checkpoint_engine import CheckpointEngineRegistry
    from verl.utils.import_utils import import_external_libs

    import_external_libs("refitflow.integrations.verl")  # what verl does with custom_backend_module
    return CheckpointEngineRegistry.new("refitflow", bucket_size=1 << 20, **(KWARGS | extra))


def _actor(rank: int, engine: Any, command: str, args: Any) -> Any:
    from tests.integrations._tiny import canonical

    if command == "send":  # verl's generator: HF-named whole tensors, made as they are consumed
        version, seed = args
        weights = ((n, t) for n, t in canonical(MODEL, seed).items())
        return anyio.run(functools.partial(engine.send_weights, weights, global_steps=version))
    raise ValueError(command)


def _rollout(state: dict[str, Any], engine: Any, command: str, args: Any) -> Any:
    from tests.integrations._vllm_rank import expected, holds

    if command == "receive":
        version, seed = args

        async def drain() -> list[Any]:
            return [item async for item in engine.receive_weights(global_steps=version)]

        yielded = anyio.run(drain)
        vllm = state["stand_in"].engine
        return {"yielded": len(yielded), "holds": holds(state["model"], expected(MODEL, seed, 1, 0)),
                "status": vllm.status, "calls": list(state["stand_in"].calls)}  # fmt: skip
    raise ValueError(command)


def run_role(role: str, inbox: Any, outbox: Any) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    rank = int(role.removeprefix("actor")) if role.startswith("actor") else None
    engine = make_backend(is_master=True) if rank == 0 else make_backend()
    state: dict[str, Any] = {}
    if rank is None:
        from tests.integrations._vllm_rank import make_engine

        vllm, state["model"] = make_engine(MODEL, 1, 0)
        state["stand_in"] = WorkerStandIn(vllm)
    while True:
        command, args = inbox.get(timeout=300)
        try:
            if command == "stop":
                engine.close()
                if rank is None:
                    state["stand_in"].engine.shutdown()
                outbox.put((role, command, None))
                return
            if command == "prepare":
                value: Any = engine.prepare()
            elif command == "init":
                engine.init_process_group(**args)
                if rank is None and engine.server is not None:
                    engine.attach_server(state["stand_in"])
                value = engine.server is not None if rank is None else None
            elif command == "finalize":
                value = engine.finalize()
            elif rank is not None:
                value = _actor(rank, engine, command, args)
            else:
                value = _rollout(state, engine, command, args)
        except Exception as exc:
            value = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
        outbox.put((role, command, value))
