"""``RefitflowCheckpointEngine``: verl's checkpoint-engine backend ``refitflow`` (imports verl).

verl's ``CheckpointEngineManager.update_weights`` runs, for every weight sync::

    prepare (every actor and rollout worker) → build_topology → init_process_group (each)
      → actor: send_weights(weights, global_steps) ∥ rollout: update_weights → receive_weights(global_steps)
      → finalize (each)

Here:

- ``prepare``: actor rank 0 (``is_master``) serves the registry on its first call unless
  ``engine_kwargs.refitflow.registry`` names one, and returns its address; the others return nothing.
- ``build_topology``: every worker gets the registry address; each actor rank its rank, the actor
  world size and the number of inference ranks (a version is released when that many are done).
- ``init_process_group``: the actor ranks open their publishers (once; kept across syncs); the
  rollout workers learn the registry and whether they drive a server (the first of each replica).
- ``send_weights``: this rank's part of every tensor (``trainer.py``) is published as version
  ``global_steps`` (or the next one), then waits until every inference rank is done with it.
- ``receive_weights``: yields no tensors. The driving worker refits its replica's vLLM server through
  refitflow's vLLM backend (``rollout.py``): each vLLM worker pulls only its slice over NIXL. The
  generator does it when first iterated and ends empty — ``wire_format = "delta_flush"``, because
  verl's vLLM adapter reads the first item of a delta stream before it calls into the server (an
  empty stream: "nothing changed", only the step is recorded), while for ``named_tensors`` it first
  starts its own IPC receive on every vLLM worker, which would hold them while the refit waits.
- ``finalize``: nothing to free: the publisher's buffers stay registered for the next version.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from typing import Any

import anyio.to_thread
from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry

from refitflow.core.errors import ConfigError
from refitflow.integrations.verl.config import VerlBackendConfig
from refitflow.integrations.verl.rollout import RayVllmServer, VllmServer, init_server, refit_server
from refitflow.integrations.verl.trainer import TrainerSide, collect

__all__ = ["BACKEND", "RefitflowCheckpointEngine"]

BACKEND = "refitflow"
REQUEST_TIMEOUT_S = 60.0  # one of vLLM's quick calls (start, finish, init beyond its own deadline)


@CheckpointEngineRegistry.register(BACKEND)
class RefitflowCheckpointEngine(CheckpointEngine):  # type: ignore[misc, unused-ignore]
    wire_format = "delta_flush"  # see the module docstring: no tensors flow through verl's adapter

    def __init__(self, bucket_size: int, is_master: bool = False, **engine_kwargs: Any) -> None:
        self.bucket_size = bucket_size  # unused: refitflow sizes its own reads (the inference side's budget)
        self.is_master = is_master
        self.config = VerlBackendConfig.of(engine_kwargs)
        self.registry: str | None = self.config.registry
        self.trainer: TrainerSide | None = None
        self.server: VllmServer | None = None  # set on the rollout worker that drives its replica
        self._initialised = False
        self._asked = 0  # the last version this rollout worker asked its server for

    # -- verl's hooks -------------------------------------------------------------------------------

    def prepare(self) -> dict[str, Any]:
        if self.is_master and self.registry is None:
            self.registry = self._trainer().serve_registry()
        return {"registry": self.registry if self.is_master else None}

    @classmethod
    def build_topology(
        cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        registry = next((m["registry"] for m in metadata if m.get("registry")), None)
        actor: dict[str, list[Any]] = {
            "registry": [registry] * actor_wg_world_size,
            "rank": list(range(actor_wg_world_size)),
            "world_size": [actor_wg_world_size] * actor_wg_world_size,
            "receivers": [rollout_world_size] * actor_wg_world_size,
        }
        rollout: dict[str, list[Any]] = {
            "registry": [registry] * rollout_world_size,
            "rollout_rank": list(range(rollout_world_size)),
        }
        return actor, rollout

    def init_process_group(self, **kwargs: Any) -> None:
        """``kwargs``: this worker's column of ``build_topology``."""
        registry, rollout_rank = kwargs.get("registry"), kwargs.get("rollout_rank")
        rank, world_size, receivers = kwargs.get("rank"), kwargs.get("world_size"), kwargs.get("receivers")
        if registry is None:
            raise ConfigError(
                "no registry address: set engine_kwargs.refitflow.registry, or let actor rank 0 serve one"
            )
        self.registry = registry
        if rollout_rank is None:  # an actor rank
            if rank is None or world_size is None or receivers is None:
                raise ConfigError("init_process_group: an actor rank needs rank, world_size and receivers")
            self._trainer().open(registry=registry, rank=rank, world_size=world_size, receivers=receivers)
        elif rollout_rank % self.config.replica_size == 0 and self.server is None:
            replica = rollout_rank // self.config.replica_size
            self.server = RayVllmServer(self.config.server_actor.format(replica=replica))

    def finalize(self) -> None:
        """Nothing per sync: the publisher's buffers stay registered, the servers keep their receivers."""

    async def send_weights(self, weights: Iterable[tuple[str, Any]], global_steps: int | None = None) -> dict:
        trainer = self._trainer()
        if trainer.rows is None:
            raise ConfigError("send_weights before init_process_group: verl's manager calls prepare, then it")
        tensors = await collect(weights, trainer.rows)
        version = trainer.next_version(global_steps)
        return await anyio.to_thread.run_sync(trainer.publish, version, tensors)

    async def receive_weights(self, global_steps: int | None = None) -> AsyncIterator[Any]:  # type: ignore[override, unused-ignore]
        if self.server is not None:
            if self.registry is None:
                raise ConfigError("receive_weights before init_process_group: no registry address")
            if not self._initialised:
                await init_server(self.server, self.config.init_info(self.registry),
                                  timeout_s=self.config.init_timeout_s + REQUEST_TIMEOUT_S)  # fmt: skip
                self._initialised = True
            version = max(global_steps or 0, self._asked + 1)  # the newest complete one at or above
            await refit_server(
                self.server, version, timeout_s=self.config.update_timeout_s,
                vote_timeout_s=self.config.vote_timeout_s, request_timeout_s=REQUEST_TIMEOUT_S,
            )  # fmt: skip
            self._asked = version
        return
        yield  # an async generator that yields nothing: no tensor passes through verl

    # -- helpers ------------------------------------------------------------------------------------

    def attach_server(self, server: VllmServer) -> None:
        """Drive ``server`` instead of the Ray actor verl runs (a server reached some other way)."""
        self.server = server

    def _trainer(self) -> TrainerSide:
        if self.trainer is None:
            self.trainer = TrainerSide(self.config)
        return self.trainer

    def close(self) -> None:
        """Stop the publisher (and the registry rank 0 serves); verl has no hook for it, the process exit does it."""
        trainer, self.trainer = self.trainer, None
        if trainer is not None:
            trainer.close()
