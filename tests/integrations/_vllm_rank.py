"""vLLM workers of the tests: the real ``WeightTransferConfig``/``ParallelConfig``/``VllmConfig`` and factory,
over a ``FusedModel`` (see there), and one rank's scripted lifecycle for the two-process engine test."""

from __future__ import annotations

import datetime
import os
import traceback
from types import SimpleNamespace
from typing import Any

import torch

from refitflow.layouts import Parallel, fused
from refitflow.layouts.canonical import from_canonical
from tests.integrations._fused_model import SENTINEL, FusedModel
from tests.integrations._tiny import canonical, config, dims


def make_engine(kind: str, tp: int, rank: int, model: torch.nn.Module | None = None,
                fill: float = SENTINEL) -> tuple[Any, FusedModel]:  # fmt: skip
    """Build one worker's engine the way vLLM's worker does: plugins loaded, then the factory."""
    from vllm.config import DeviceConfig, ParallelConfig, VllmConfig
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # runs refitflow's vllm.general_plugins entry point, as every vLLM process does
    vc = VllmConfig(
        parallel_config=ParallelConfig(tensor_parallel_size=tp, rank=rank), device_config=DeviceConfig(device="cpu"),
        weight_transfer_config=WeightTransferConfig(backend="refitflow"),
    )  # fmt: skip
    # a real ModelConfig inspects vLLM's model class, which needs its CUDA kernels: this stand-in carries the
    # real transformers config, which is all the backend reads from it
    vc.model_config = SimpleNamespace(hf_config=config(kind))
    model = model if model is not None else FusedModel(dims(kind), tp, rank, fill=fill)
    engine = WeightTransferEngineFactory.create_engine(vc.weight_transfer_config, vc, torch.device("cpu"), model)
    return engine, model  # type: ignore[return-value]


def expected(kind: str, seed: int, tp: int, rank: int) -> dict[str, torch.Tensor]:
    """What rank ``rank`` must hold after committing version ``seed``: its fused slices, padding untouched."""
    d = dims(kind)
    canon = canonical(kind, seed)
    local = from_canonical(fused.layout(d, Parallel(tp=tp, tp_rank=rank)), canon)  # vocabulary rows: below
    model = FusedModel(d, tp, rank)
    out = {}
    for name, p in model.named_parameters():
        name_in_table = name.replace(".block_sparse_moe.", ".mlp.")
        t = p.detach().clone()
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            rows = canon[name][rank * model.vocab_rows : (rank + 1) * model.vocab_rows]
            t[: rows.shape[0]] = rows
        else:
            t.copy_(local[name_in_table])
        out[name] = t
    return out


def holds(model: torch.nn.Module, want: dict[str, torch.Tensor]) -> bool:
    got = dict(model.named_parameters())
    return set(got) == set(want) and all(torch.equal(got[n].detach(), w) for n, w in want.items())


def run_rank(rank: int, port: int, registry: str, mode: str, go: list[Any], done: Any) -> None:
    """One worker process of a TP-2 engine: versions 1 (good), 2 (corrupted on rank 0's slice), 3 (good).

    The vote's addresses are exchanged over a torch.distributed gloo group, as they are over vLLM's.
    """
    import torch.distributed as dist

    torch.set_num_threads(1)
    report: dict[str, Any] = {"rank": rank}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=60))  # fmt: skip
        engine, model = make_engine("qwen2", 2, rank)
        pointers = {n: p.data_ptr() for n, p in model.named_parameters()}
        engine.init_transfer_engine(engine.parse_init_info(
            {"registry": registry, "model": "tiny-vllm", "identity": {"layout": "megatron"}, "mode": mode,
             "budget_bytes": 1 << 16, "vote_timeout_s": 20}))  # fmt: skip
        report["vote"] = type(engine.session.writer.member.channel).__name__
        for version, seed in ((1, 1), (2, 2), (3, 3)):
            go[version - 1].wait(120)
            engine.start_weight_update()
            try:
                engine.update_weights({"version": version, "timeout_s": 60})
            except Exception as exc:
                report[f"v{version}"] = {"error": type(exc).__name__, "message": str(exc)[:300]}
            else:
                engine.finish_weight_update()
                report[f"v{version}"] = {"committed": True}
            want = expected("qwen2", seed if version != 2 else 1, 2, rank)
            report[f"v{version}"] |= {"holds": holds(model, want), **engine.status}
            done.put((rank, version))
        report["pointers_kept"] = pointers == {n: p.data_ptr() for n, p in model.named_parameters()}
        engine.shutdown()
    except BaseException:
        report["crash"] = traceback.format_exc()
    done.put((rank, report))
    done.close()
    done.join_thread()  # flushed before leaving
    os._exit(0)  # without the gloo group's destructor
