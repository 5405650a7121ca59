"""One FSDP2 trainer rank (``fully_shard`` over a 2-rank gloo mesh on the CPU) sending weights through vLLM's
trainer-side API with refitflow as the backend: ``WeightTransferTrainerFactory.trainer_init`` with
``RefitflowTrainerInitInfo`` and vLLM's ``ModuleSource`` over the sharded model (its DTensor parameters published
as local shards, never gathered for the transfer), ``HTTPVLLMWeightSyncClient`` to a real vLLM server.

Per version: a step that changes every local shard in place, the gathered model's greedy tokens (rank 0, for the
test's comparison only), ``send_weights`` on both ranks, then ``("sent", version, tokens, gaps)`` on ``queue``;
the next version waits for the test's ``go``. A failed ``send_weights`` puts ``("failed", rank, message)``. After
the last version and one more ``go`` (the test shut the server's backend down), one more ``send_weights``: it
fails on every rank, each reports it.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist
import transformers as tf
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import init_device_mesh

VERSIONS = (1, 2)


def main(rank: int, init_method: str, checkpoint: str, url: str, queue: Any, go: Any) -> None:
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from refitflow.integrations.vllm.trainer import RefitflowTrainerInitInfo
    from tests.integrations._hf_trainer import expected
    from tests.integrations._vllm_real import PROMPT, TOKENS

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, init_method=init_method,
                            timeout=datetime.timedelta(seconds=120))  # fmt: skip
    try:
        mesh = init_device_mesh("cpu", (2,))
        model = tf.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        info = RefitflowTrainerInitInfo(rank=rank, world_size=2, model="tiny-real", registry_bind="tcp://127.0.0.1:*",
                                        timeout_s=60, worker_init={"budget_bytes": 1 << 20})  # fmt: skip
        engine = WeightTransferTrainerFactory.trainer_init(info, client=HTTPVLLMWeightSyncClient(url, timeout=120),
                                                           source=ModuleSource(model))  # fmt: skip
        try:
            for version in VERSIONS:
                gen = torch.Generator().manual_seed(100 * version + rank)
                with torch.no_grad():
                    for p in model.parameters():  # the optimizer's step, on each rank's own shard
                        local = p.to_local()
                        local.add_(torch.randn(local.shape, generator=gen) * 0.05)
                full = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}  # every rank
                try:
                    engine.send_weights()
                except Exception as exc:
                    queue.put(("failed", rank, f"{type(exc).__name__}: {exc}"))
                    return
                if rank == 0:
                    truth = tf.LlamaForCausalLM(model.config)
                    truth.load_state_dict(full)
                    tokens, gaps = expected(truth.eval(), {"prompt": PROMPT, "tokens": TOKENS, "dtype": "float32"})
                    queue.put(("sent", version, tokens, gaps))
                    go.get(timeout=120)
                dist.barrier()
            if rank == 0:
                go.get(timeout=120)  # the test has shut the server's refitflow backend down
            dist.barrier()
            try:  # the sender's failure reaches every rank over the group
                engine.send_weights()
                queue.put(("sent", rank, "a version the server could not take"))
            except Exception as exc:
                queue.put(("failed", rank, f"{type(exc).__name__}: {exc}"))
        finally:
            engine.shutdown()
    finally:
        dist.destroy_process_group()
