"""refitflow as the ``weight_transfer`` of TRL's experimental ``AsyncGRPOTrainer`` (TRL's own seam: any object with
``init_weight_transfer``, ``pause``, ``send_weights(iterator)``, ``resume``, ``destroy``)::

    from refitflow.integrations.trl import RefitflowWeightTransfer
    trainer = AsyncGRPOTrainer(model=..., args=AsyncGRPOConfig(vllm_server_base_url=url, ...), ...,
                               weight_transfer=RefitflowWeightTransfer(url, model="qwen3-8b", hf_config=config))

TRL calls it on its main process only: ``pause`` → ``send_weights`` of the parameters it iterates (whole tensors:
TRL gathers FSDP2 shards for this seam on every rank) → ``resume``, then bumps the version its rollout worker stamps
on new samples. Here ``pause`` and ``resume`` do nothing — the server is never paused: ``send_weights`` publishes
the tensors as version ``v`` (no copy of a plain parameter; TRL's gathered tensors are held until released) and
drives the server's no-drain update (pulled, verified, voted, swapped between two steps). A request in flight at
the swap finishes with the new weights (its tokens after the swap are labelled with the new version by vLLM); TRL
stamps its sample with the version current when it started — the older of the two, so TRL's ``max_staleness`` and
its off-policy correction (vLLM's sampled log-probabilities are the behaviour policy's, token by token) stay on the
safe side. Version ``v`` is the ``v``-th send, as TRL's ``model_version`` counts.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import torch

from refitflow.core.errors import ConfigError
from refitflow.integrations.trl.options import RefitflowTrl
from refitflow.integrations.vllm.trainer import RefitflowTrainerEngine, RefitflowTrainerInitInfo
from refitflow.integrations.vllm.weight_transfer import (
    HTTPVLLMWeightSyncClient,
    WeightSource,
    WeightTransferTrainerFactory,
    submodule,
)

__all__ = ["RefitflowWeightTransfer"]


class _Tensors(WeightSource):
    """The tensors of one send, as a vLLM ``WeightSource`` of whole tensors."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    @functools.cached_property
    def metadata(self) -> list[Any]:  # vLLM requires a cached_property: engines read it repeatedly
        meta = submodule("base").ParamMeta
        return [meta(name=n, dtype=t.dtype, shape=tuple(t.shape)) for n, t in self.tensors.items()]

    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.tensors.items()


class RefitflowWeightTransfer:
    """TRL's ``WeightTransferProtocol`` over refitflow (one trainer rank: TRL's main process)."""

    def __init__(self, server_url: str, *, hf_config: Any,
                 options: RefitflowTrl | dict[str, Any] | None = None) -> None:  # fmt: skip
        if hf_config is None:
            raise ConfigError("RefitflowWeightTransfer needs hf_config= (the model's transformers config): the server "
                              "maps HF names by its dimensions")  # fmt: skip
        self.url, self.hf_config = server_url.rstrip("/"), hf_config
        self.options = RefitflowTrl.parse(options)
        self.engine: RefitflowTrainerEngine | None = None
        self.sent = 0  # versions committed on the server
        self.sync_seconds: list[float] = []

    def init_weight_transfer(self) -> None:
        opts = self.options
        info = RefitflowTrainerInitInfo(rank=0, world_size=1, model=opts.model, registry=opts.registry,
                                        registry_bind=opts.registry_bind, advertise_host=opts.advertise_host,
                                        mode="shadow", no_drain=True, worker_init=dict(opts.worker_init),
                                        hf_config=self.hf_config, timeout_s=opts.timeout_s)  # fmt: skip
        client = HTTPVLLMWeightSyncClient(self.url, timeout=opts.timeout_s)
        engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=_Tensors({}))
        assert isinstance(engine, RefitflowTrainerEngine)
        self.engine = engine

    def pause(self) -> None:
        """Nothing: the server keeps generating while it takes the next version."""

    def resume(self) -> None:
        """Nothing: it never stopped."""

    def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        import time

        if self.engine is None:
            raise ConfigError("send_weights before init_weight_transfer")
        start = time.perf_counter()
        self.engine.source = _Tensors({name: tensor.detach() for name, tensor in iterator})
        self.engine.send_weights()  # returns once committed on the server and released by it
        self.sent += 1
        self.sync_seconds.append(time.perf_counter() - start)

    def destroy(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
