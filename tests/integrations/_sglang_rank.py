"""One SGLang scheduler's weight-update side, in its own process (one per TP rank, as SGLang runs them).

Real SGLang 0.5.23 on a CPU machine (``_sglang_stub``): ``ServerArgs`` published into SGLang's runtime
context (``--custom-weight-loader`` = refitflow's loader), SGLang's plugin loader run first (it finds
refitflow's ``sglang.srt.plugins`` entry point and applies its hook), SGLang's distributed groups built
over gloo, and the scheduler's ``SchedulerWeightUpdaterManager`` over the model runner's
``WeightUpdater`` — the code that runs ``begin_weight_update``, ``update_weights_from_tensor`` (which
calls the custom loader) and ``end_weight_update`` in a real server. The model is a ``FusedModel``
(SGLang's model classes need its CUDA kernels); its names and shapes are SGLang's for Qwen2 (vLLM's
fused names; vocabulary padded to 64). The scheduler's event loop is replaced by ``serve``: requests
arrive on a pipe from the server process (``_sglang_server``).
"""

from __future__ import annotations

import os
import sys
import traceback
from types import SimpleNamespace
from typing import Any

from tests.integrations._sglang_stub import stub_torchvision


def serve(conn: Any, rank: int, spec: dict[str, Any]) -> None:
    """``spec``: ``{"tp", "config", "plugins", "dist_port"}``. Answers ``("ready", None)`` then each request."""
    try:
        updater, model = _start(rank, spec)
        conn.send(("ready", None))
    except BaseException:
        conn.send(("crash", traceback.format_exc()))
        raise
    while True:
        try:
            method, arg = conn.recv()
        except EOFError:
            break
        try:
            conn.send(("ok", _handle(updater, model, rank, spec, method, arg)))
        except BaseException:
            conn.send(("crash", traceback.format_exc()))
    os._exit(0)  # without the gloo groups' destructors


def _start(rank: int, spec: dict[str, Any]) -> tuple[Any, Any]:
    stub_torchvision()
    sys.path.insert(0, spec["plugins"])  # refitflow's entry point, as pip writes it from pyproject.toml
    from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from sglang.srt.managers.scheduler_components.weight_updater import SchedulerWeightUpdaterManager
    from sglang.srt.managers.tp_worker import TpModelWorker
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater
    from sglang.srt.plugins import load_plugins
    from sglang.srt.runtime_context import SpawnRanks, get_model, publish
    from sglang.srt.server_args import ServerArgs

    from refitflow.integrations.sglang.payload import LOADER
    from tests.integrations._fused_model import FusedModel
    from tests.integrations._tiny import config, dims

    load_plugins()  # first, as SGLang's run_scheduler_process does
    tp = spec["tp"]
    args = ServerArgs(model_path=spec["config"], device="cpu", tp_size=tp, custom_weight_loader=[LOADER],
                      load_format="dummy", skip_tokenizer_init=True)  # fmt: skip
    publish(args, role="scheduler", ranks=SpawnRanks(world_rank=rank))
    init_distributed_environment(backend="gloo", world_size=tp, rank=rank, local_rank=rank,
                                 distributed_init_method=f"tcp://127.0.0.1:{spec['dist_port']}")  # fmt: skip
    initialize_model_parallel(backend="gloo")
    model = FusedModel(dims("qwen2"), tp, rank, fill=spec.get("fill", 7.0))
    model.config = config("qwen2")  # SGLang's models keep their HF config as .config
    runner = SimpleNamespace(weight_updater=WeightUpdater(
        tp_rank=rank, device="cpu", gpu_id=0, model_config=None, custom_weight_loaders=get_model().custom_weight_loader,
        get_model=lambda: model, update_model_fields=lambda *a, **k: None, recapture_cuda_graph=lambda: None,
        get_model_runner=lambda: None,
    ))  # fmt: skip
    worker = SimpleNamespace(
        weight_update_runners=lambda: [("target", runner)],
        deserialize_own_rank=lambda payloads: TpModelWorker.deserialize_own_rank(None, payloads),
    )
    scheduler = SimpleNamespace(versions=[])
    scheduler.record_weight_version_change = lambda new_version: scheduler.versions.append(new_version)
    updater = SchedulerWeightUpdaterManager(
        tp_worker=worker, draft_worker=None, memory_saver_adapter=None, flush_cache=lambda empty_cache=False: True,
        is_fully_idle=lambda **_: True, scheduler=scheduler,
    )  # fmt: skip
    model.pointers = {n: p.data_ptr() for n, p in model.named_parameters()}
    return updater, model


def _handle(updater: Any, model: Any, rank: int, spec: dict[str, Any], method: str, arg: Any) -> Any:
    from refitflow.integrations.sglang import loader
    from tests.integrations._vllm_rank import LostVerdict, expected, holds

    if method in ("begin_weight_update", "end_weight_update", "update_weights_from_tensor"):
        out = getattr(updater, method)(arg)
        return SimpleNamespace(success=out.success, message=out.message)
    worker = loader.workers().get(id(model))
    if method == "lose_verdict":  # this rank's next engine-vote verdict is lost on its way back
        member = worker.session.member
        member.channel = LostVerdict(member.channel)
        return None
    if method == "state":  # arg: the seed of the version the rank should hold (None: do not compare)
        return {
            "holds": None if arg is None else holds(model, expected("qwen2", arg, spec["tp"], rank)),
            "pointers_kept": model.pointers == {n: p.data_ptr() for n, p in model.named_parameters()},
            "versions": list(updater.scheduler.versions),
            **(worker.status if worker else {}),
        }
    raise ValueError(method)
