"""refitflow as vLLM's *trainer-side* weight-transfer engine: RL code that already sends weights through vLLM's
``WeightTransferTrainerFactory`` switches by one name — its init info::

    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from refitflow.integrations.vllm.trainer import RefitflowTrainerInitInfo

    engine = WeightTransferTrainerFactory.trainer_init(
        RefitflowTrainerInitInfo(rank=rank, world_size=world, model="qwen3-8b"),
        client=HTTPVLLMWeightSyncClient("http://inference-0:8000"), source=ModuleSource(model))
    ...
    engine.send_weights()   # every trainer rank, after each optimizer step

On every trainer rank ``trainer_init`` opens a ``Publisher`` (rank 0 also serves the registry when none is
given; its address reaches the other ranks over torch.distributed), and the sender (rank 0) initialises
every server's refitflow backend through the client. ``send_weights`` publishes the next version from the
``WeightSource`` — a ``ModuleSource``'s live parameters with no copy, FSDP2 ``DTensor`` parameters as their
local shards with no gather (``rf.Publisher``); another source's pieces (``iter_local`` over one sharded
mesh axis) or whole tensors — each replicated tensor from one rank only (spread over the ranks); then the
sender drives start → update → finish through the client, by default without draining (``mode="shadow"``,
``no_drain``: the servers never stop generating), and every rank returns once the version is committed and
released (the tensors may change then). A failure raises ``RefitError`` naming the server's answer (what it
serves now is in it) on the sender and, when a process group exists, on every rank.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import socket
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar, Self

import torch
from torch.distributed.tensor import Shard as TorchShard

import refitflow as rf
from refitflow.core.errors import ConfigError, RefitError
from refitflow.integrations.hosting.info import RefitflowInitInfo
from refitflow.integrations.hosting.keys import deployment_keys
from refitflow.integrations.hosting.loop_thread import LoopThread
from refitflow.integrations.vllm.weight_transfer import (
    ModuleSource,
    Shard,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
    WeightTransferTrainerFactory,
)
from refitflow.layouts import Parallel, hf
from refitflow.layouts.wire import layout_metadata
from refitflow.registry.keys import client_of, server_of

__all__ = ["RefitflowTrainerEngine", "RefitflowTrainerInitInfo"]

log = logging.getLogger(__name__)


@dataclass
class RefitflowTrainerInitInfo(TrainerInitInfo):
    """What each trainer rank passes (``rank`` keyword-only, from vLLM's base class)."""

    backend: ClassVar[str] = "refitflow"

    model: str = "policy"  # the publication's identity (and the servers' init info model)
    world_size: int = 1  # trainer ranks publishing each version together
    registry: str | None = None  # a registry service; None: rank 0 serves one at ``registry_bind``
    registry_bind: str = "tcp://0.0.0.0:*"  # the address rank 0 binds (``*``: any free port)
    advertise_host: str | None = None  # the host servers reach it at (default: as bound; 0.0.0.0: this host's IP)
    mode: str = "shadow"  # the servers' apply mode (in_place: pause the servers around send_weights yourself)
    no_drain: bool = True  # shadow: the servers keep generating while they pull (docs/vllm.md)
    worker_init: dict[str, Any] = field(default_factory=dict)  # more RefitflowInitInfo fields for the servers
    hf_config: Any = None  # the model's transformers config (default: a ModuleSource's module's ``config``)
    timeout_s: float = 600.0  # one send_weights: publishing, the servers' update, the release

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank {self.rank} must lie in [0, world_size={self.world_size})")
        if self.no_drain and self.mode != "shadow":
            raise ConfigError("no_drain needs mode='shadow'; with mode='in_place' set no_drain=False and pause the "
                              "servers around send_weights")  # fmt: skip


class RefitflowTrainerEngine(TrainerWeightTransferEngine[RefitflowTrainerInitInfo]):
    init_info_cls = RefitflowTrainerInitInfo

    def __init__(self, info: RefitflowTrainerInitInfo, *, client: VLLMWeightSyncClient, source: WeightSource) -> None:
        super().__init__(client=client, source=source, is_sender=info.is_sender, rank=info.rank)
        self.info = info
        self.versions = itertools.count(1)
        self.loop = LoopThread(f"refitflow-trainer-{info.rank}")
        self._stack = contextlib.AsyncExitStack()
        self.publisher: rf.Publisher | None = None
        self.registry_address = info.registry
        self._held: dict[int, list[torch.Tensor]] = {}  # per version: what this rank published, until released

    @classmethod
    def trainer_init(cls, init_info: RefitflowTrainerInitInfo, *, client: VLLMWeightSyncClient,
                     source: WeightSource | None = None) -> Self:  # fmt: skip
        if source is None:
            raise ConfigError("the refitflow trainer engine publishes from a WeightSource: pass source=")
        engine = cls(init_info, client=client, source=source)
        try:
            engine.loop.run(engine._open, timeout=120.0, what="opening the refitflow publisher")
            if engine.is_sender:
                fields = {
                    "identity": {"layout": "hf"},
                    "mode": init_info.mode,
                    "shadow_commit": "swap" if init_info.mode == "shadow" else "copy",
                    **init_info.worker_init,
                }
                worker = RefitflowInitInfo(registry=engine.registry_address or "", model=init_info.model,
                                           **fields)  # fmt: skip
                engine._call("init_weight_transfer_engine", worker.to_dict())
        except BaseException:
            engine.shutdown()
            raise
        return engine

    async def _open(self) -> None:
        registry: Any = self.registry_address
        keys = deployment_keys("trainer")
        if self.info.is_sender and registry is None:
            server = await self._stack.enter_async_context(
                rf.Registry.serve(self.info.registry_bind, security=server_of(keys), insecure=keys is None)
            )
            bound, port = server.address.removeprefix("tcp://").rsplit(":", 1)
            host = self.info.advertise_host or (socket.gethostbyname(socket.gethostname()) if bound == "0.0.0.0"
                                                else bound)  # fmt: skip
            self.registry_address = f"tcp://{host}:{port}"
            registry = server.registry
        self.registry_address = _shared(self.registry_address, self.info)
        if registry is None:
            registry = self.registry_address
        self.publisher = await self._stack.enter_async_context(rf.Publisher(
            registry, identity=rf.Identity(model=self.info.model, layout="hf"), rank=self.info.rank,
            world_size=self.info.world_size, transport="nixl",
            security=client_of(keys) if isinstance(registry, str) else None))  # fmt: skip

    def send_weights(self) -> None:
        version = next(self.versions)
        tensors = dict(self._mine())
        self.loop.run(
            self._publish, version, tensors, timeout=self.info.timeout_s, what=f"publishing version {version}"
        )
        error: str | None = None
        if self.is_sender:
            try:
                self._call("start_weight_update")
                self._call("update_weights", {"version": version, "no_drain": self.info.no_drain,
                                              "timeout_s": self.info.timeout_s})  # fmt: skip
                self._call("finish_weight_update", str(version))
            except RefitError as exc:
                error = str(exc)
        error = _shared_outcome(error, self.info)
        if error is not None:
            raise RefitError(f"version {version} was not committed: {error}", version=version)
        self.loop.run(self._released, version, timeout=self.info.timeout_s, what=f"the release of version {version}")

    def _mine(self) -> Iterator[tuple[str, Any]]:
        """This rank's share of every parameter, in metadata order (every owner iterates: collectives line up)."""
        source, rank, world = self.source, self.info.rank, self.info.world_size
        assert source is not None
        metas = {m.name: m for m in source.metadata}
        index = {name: i for i, name in enumerate(metas)}
        if isinstance(source, ModuleSource):  # the live parameters: no copy, DTensors as their local shards
            named = source._module.named_parameters()
            yield from ((n, p.detach()) for n, p in named if _publishes(metas[n], index[n], rank, world))
            return
        local = source.implements_iter_local() and all(_one_axis(m) for m in metas.values())
        for name, tensor in source.iter_local() if local else source.iter_full():
            meta = metas[name]
            if local and meta.placements is not None:
                assert meta.owners is not None
                axis = meta.placements[0]
                assert isinstance(axis, Shard)
                step = -(-meta.shape[axis.dim] // len(meta.owners))  # torch.chunk's
                start = step * meta.owners.index(rank)
                yield name, rf.Sharded(tensor=tensor.detach(), axis=axis.dim, start=start, global_shape=meta.shape)
            elif _publishes(meta, index[name], rank, world):
                yield name, tensor.detach()

    async def _publish(self, version: int, tensors: dict[str, Any]) -> None:
        assert self.publisher is not None
        self._held[version] = [getattr(t, "tensor", t) for t in tensors.values()]  # alive until released
        # whole tensors name their HF layout (the servers map HF names through it); parts of tensors (DTensor
        # shards, pieces) go as canonical tensors, which for HF names are the same (a layout takes whole tensors)
        whole = not any(isinstance(t, rf.Sharded) or _sharded(t) for t in tensors.values())
        await self.publisher.publish(version, tensors, metadata=_layout(self.source, self.info) if whole else None)

    async def _released(self, version: int) -> None:
        assert self.publisher is not None
        await self.publisher.released(version, timeout=self.info.timeout_s)
        for v in [v for v in self._held if v <= version]:
            del self._held[v]

    def _call(self, method: str, *args: Any) -> None:
        """One client call; a failure is a ``RefitError`` with the server's answer."""
        try:
            getattr(self.client, method)(*args)
        except Exception as exc:
            body = getattr(getattr(exc, "response", None), "text", "") or ""
            raise RefitError(f"{method} failed: {type(exc).__name__}: {exc} {body[:2000]}".strip()) from exc

    def shutdown(self) -> None:
        with contextlib.suppress(Exception):
            self.loop.run(self._stack.aclose, timeout=30.0, what="closing the refitflow publisher")
        self.loop.close()


def _publishes(meta: Any, index: int, rank: int, world: int) -> bool:
    """Whether ``rank`` publishes the ``index``-th parameter: a sharded one from every owner (its part), a
    replicated one from one owner only, spread over them by index (every rank sends about as much)."""
    if meta.placements is not None:
        return True
    if meta.owners is None:
        return index % world == rank
    return bool(meta.owners[index % len(meta.owners)] == rank)


def _layout(source: Any, info: RefitflowTrainerInitInfo) -> dict[str, str]:
    """The HF layout the tensors are in (``metadata["layout"]``), from the model's transformers config: the
    init info's ``hf_config``, else a ``ModuleSource``'s module's ``config``."""
    config = info.hf_config if info.hf_config is not None else getattr(getattr(source, "_module", None), "config", None)
    if config is None:
        raise ConfigError("the servers map HF names by the model's dimensions: pass hf_config= (the model's "
                          "transformers config), or a ModuleSource over a transformers model")  # fmt: skip
    return layout_metadata("hf", hf.dims_from_config(config), Parallel())


def _sharded(tensor: Any) -> bool:
    """A DTensor sharded over its mesh (published as this rank's part)."""
    return any(isinstance(p, TorchShard) for p in getattr(tensor, "placements", ()) or ())


def _one_axis(meta: Any) -> bool:
    return meta.placements is None or (len(meta.placements) == 1 and isinstance(meta.placements[0], Shard))


def _shared(address: str | None, info: RefitflowTrainerInitInfo) -> str:
    """Rank 0's registry address on every rank (over torch.distributed when the ranks did not all get one)."""
    if info.world_size > 1 and info.registry is None:
        import torch.distributed as dist

        grouped = dist.is_available() and dist.is_initialized()
        if not grouped and info.is_sender:
            return str(address)  # the other ranks are given it (registry=)
        if not grouped:
            raise ConfigError("with world_size > 1 give every rank the registry address (registry=), or initialise "
                              "torch.distributed so rank 0 can share the one it serves")  # fmt: skip
        box = [address]
        dist.broadcast_object_list(box, src=0)
        address = box[0]
    if not address:
        raise ConfigError("no registry address")
    return address


def _shared_outcome(error: str | None, info: RefitflowTrainerInitInfo) -> str | None:
    """The sender's outcome on every rank, when the ranks share a process group."""
    import torch.distributed as dist

    if info.world_size > 1 and dist.is_available() and dist.is_initialized():
        box = [error]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return error


with contextlib.suppress(ValueError):  # registered once per process
    WeightTransferTrainerFactory.register_engine("refitflow", RefitflowTrainerEngine)
