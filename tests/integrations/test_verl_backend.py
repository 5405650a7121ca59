"""verl 0.9.1's checkpoint engine with refitflow's backend, registered through ``custom_backend_module``.

Two actor-rank processes and one rollout-worker process (``_verl_roles``) run the backend as verl runs it;
this process plays verl's ``CheckpointEngineManager``. The actor ranks publish over real NIXL to the
registry actor rank 0 serves; the rollout worker drives its vLLM server (a stand-in for Ray and verl's
server, over refitflow's real vLLM backend), whose worker pulls its slice and commits.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from typing import Any

import anyio
import pytest
import torch
from verl.checkpoint_engine import CheckpointEngineRegistry
from verl.utils.import_utils import import_external_libs

import refitflow as rf
from tests._keys import KEYS
from tests.integrations._tiny import canonical
from tests.integrations._verl_roles import MODEL, run_role

os.environ.setdefault("UCX_NET_DEVICES", "lo")
ROLES = ("actor0", "actor1", "rollout0")


def test_a_verl_config_selects_the_backend_by_name_through_custom_backend_module() -> None:
    import_external_libs("refitflow.integrations.verl")
    engine_cls = CheckpointEngineRegistry.get("refitflow")
    assert engine_cls.__name__ == "RefitflowCheckpointEngine"
    with pytest.raises(rf.ConfigError, match="unknown settings"):
        CheckpointEngineRegistry.new("refitflow", bucket_size=1, model="m", regsitry="tcp://h:1")
    with pytest.raises(rf.ConfigError, match="vllm may not set"):
        CheckpointEngineRegistry.new("refitflow", bucket_size=1, model="m", vllm={"registry": "tcp://h:1"})
    actor, rollout = engine_cls.build_topology(2, 4, [{"registry": "tcp://h:1"}] + [{"registry": None}] * 5)
    assert actor["rank"] == [0, 1] and actor["receivers"] == [4, 4] and rollout["registry"] == ["tcp://h:1"] * 4


class Manager:
    """verl's CheckpointEngineManager, step by step, over the role processes' queues."""

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self.outbox = ctx.Queue()
        self.inboxes = {role: ctx.Queue() for role in ROLES}
        self.procs = [ctx.Process(target=run_role, args=(r, self.inboxes[r], self.outbox)) for r in ROLES]
        for p in self.procs:
            p.start()

    def ask(self, commands: dict[str, tuple[str, Any]], timeout: float = 240) -> dict[str, Any]:
        for role, command in commands.items():
            self.inboxes[role].put(command)
        answers = {}
        for _ in commands:
            role, _command, value = self.outbox.get(timeout=timeout)
            assert not (isinstance(value, dict) and "error" in value), f"{role}: {value.get('trace')}"
            answers[role] = value
        return answers

    def sync(self, version: int, seed: int) -> dict[str, Any]:
        """One weight sync: prepare → build_topology → init_process_group → send ∥ receive → finalize."""
        meta = self.ask({r: ("prepare", None) for r in ROLES})
        actor, rollout = CheckpointEngineRegistry.get("refitflow").build_topology(2, 1, [meta[r] for r in ROLES])
        init = {f"actor{i}": ("init", {k: v[i] for k, v in actor.items()}) for i in (0, 1)}
        drives = self.ask(init | {"rollout0": ("init", {k: v[0] for k, v in rollout.items()})})["rollout0"]
        assert drives, "rollout rank 0 drives its replica's server"
        send = {f"actor{i}": ("send", (version, seed)) for i in (0, 1)}
        out = self.ask(send | {"rollout0": ("receive", (version, seed))})
        self.ask({r: ("finalize", None) for r in ROLES})
        return out

    def stop(self) -> None:
        try:
            self.ask({r: ("stop", None) for r in ROLES}, timeout=60)
        finally:
            for p in self.procs:
                p.join(30)
                if p.exitcode is None:
                    p.kill()


def test_the_registered_backend_round_trips_versions_from_actor_ranks_to_a_vllm_worker() -> None:
    manager = Manager()
    try:
        first = manager.sync(1, seed=1)
        second = manager.sync(2, seed=2)
    finally:
        manager.stop()
    model_bytes = sum(t.nbytes for t in canonical(MODEL, 1).values())
    for out, version in ((first, 1), (second, 2)):
        rollout = out["rollout0"]
        assert rollout["yielded"] == 0  # no tensor passes through verl
        assert rollout["holds"], f"version {version} not bit-exact on the vLLM worker"
        assert rollout["status"]["committed_version"] == version and rollout["status"]["fence"] == "ready"
        sent = [out[f"actor{i}"] for i in (0, 1)]
        assert all(m["refitflow/version"] == version for m in sent)
        # each actor rank published only its rows: together every byte exactly once, about half each
        assert sum(m["refitflow/published_bytes"] for m in sent) == model_bytes
        assert all(0.3 < m["refitflow/published_bytes"] / model_bytes < 0.7 for m in sent)
    assert second["rollout0"]["calls"] == [
        "init_weight_transfer_engine", "start_weight_update", "update_weights", "finish_weight_update",
        "clear_kv_cache", "start_weight_update", "update_weights", "finish_weight_update", "clear_kv_cache",
    ]  # fmt: skip


@pytest.mark.asyncio
async def test_a_refit_that_fails_on_the_server_fails_receive_weights_and_leaves_the_model_alone() -> None:
    from tests.integrations._verl_roles import WorkerStandIn, make_backend
    from tests.integrations._vllm_rank import make_engine

    vllm, model = make_engine(MODEL, 1, 0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    stand_in = WorkerStandIn(vllm)
    engine = make_backend(update_timeout_s=2.0)  # nothing is ever published: the server's wait runs out
    try:
        async with rf.Registry.serve("tcp://127.0.0.1:*", security=KEYS.server) as server:
            engine.init_process_group(registry=server.address, rollout_rank=0)
            engine.attach_server(stand_in)
            with anyio.fail_after(120), pytest.raises(rf.RefitError, match="version 1"):
                async for _ in engine.receive_weights(global_steps=1):
                    pass
    finally:
        vllm.shutdown()
    # the failed update is finished once (peers that learned COMMIT beside one in doubt), the cache kept
    assert stand_in.calls == ["init_weight_transfer_engine", "start_weight_update", "update_weights",
                              "finish_weight_update"]  # fmt: skip
    assert all(torch.equal(p.detach(), before[n]) for n, p in model.named_parameters())


@pytest.mark.asyncio
async def test_an_init_that_fails_on_one_worker_shuts_the_others_down_so_the_next_sync_inits_again() -> None:
    from tests.integrations._verl_roles import WorkerStandIn, make_backend
    from tests.integrations._vllm_rank import make_engine

    class OnePeerFails(WorkerStandIn):
        """This worker initialises; a peer of it (not run here) fails the collective init, the first time."""

        failed = False

        async def call(self, method: str, timeout: float, **kwargs: Any) -> Any:
            out = await super().call(method, timeout, **kwargs)
            if method == "init_weight_transfer_engine" and not self.failed:
                self.failed = True
                raise RuntimeError("injected: worker 1 could not initialise")
            return out

    vllm, _ = make_engine(MODEL, 1, 0)
    stand_in = OnePeerFails(vllm)
    engine = make_backend(update_timeout_s=2.0)
    try:
        async with rf.Registry.serve("tcp://127.0.0.1:*", security=KEYS.server) as server:
            engine.init_process_group(registry=server.address, rollout_rank=0)
            engine.attach_server(stand_in)
            with anyio.fail_after(120):
                with pytest.raises(rf.RefitError, match="worker 1 could not initialise"):
                    async for _ in engine.receive_weights(global_steps=1):
                        pass
                with pytest.raises(rf.RefitError, match="version 1"):  # init accepted; nothing is published
                    async for _ in engine.receive_weights(global_steps=1):
                        pass
    finally:
        vllm.shutdown()
    assert stand_in.calls[:4] == ["init_weight_transfer_engine", "shutdown_weight_transfer_engine",
                                  "init_weight_transfer_engine", "start_weight_update"]  # fmt: skip
