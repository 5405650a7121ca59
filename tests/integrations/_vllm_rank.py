"""vLLM workers of the tests: the real ``WeightTransferConfig``/``ParallelConfig``/``VllmConfig`` and factory,
over a ``FusedModel`` (see there), vLLM's real ``MLAAttention`` layers on a DeepSeek-shaped one, and one
rank's scripted lifecycle for the two-process engine test."""

from __future__ import annotations

import datetime
import os
import traceback
from types import SimpleNamespace
from typing import Any

import torch

from refitflow.engine.vote import Ballot, Decision, Verdict, VoteChannel
from refitflow.integrations.hosting.load_weights import checkpoint_names
from tests.integrations._fused_model import SENTINEL, FusedModel
from tests.integrations._tiny import canonical, config, dims


class LostVerdict:
    """A vote channel whose verdict is lost on its way back once (the real ZMQ vote runs underneath): the rank
    is in doubt. ``lost_answers``: that many of its questions to the peers (``resolve``) get no answer
    either — the update's own one question by default, so the rank stays in doubt until the next update. A
    lost message cannot be provoked on purpose over loopback; the peers, the coordinator and ``resolve``
    are the real ones."""

    def __init__(self, inner: VoteChannel, lost_answers: int = 1) -> None:
        self.inner, self.rank, self.size, self.lose = inner, inner.rank, inner.size, True
        self.lost_answers = lost_answers
        self.resolved: list[Verdict] = []

    @property
    def attempt(self) -> int:
        return self.inner.attempt

    async def vote(self, ballot: Ballot, timeout: float) -> Verdict:
        verdict = await self.inner.vote(ballot, timeout)
        if self.lose:
            self.lose = False
            return Verdict(verdict.attempt, Decision.IN_DOUBT, None, "no verdict from the coordinator")
        return verdict

    async def resolve(self, attempt: int, timeout: float) -> Verdict:
        if self.lost_answers:
            self.lost_answers -= 1
            return Verdict(attempt, Decision.IN_DOUBT, None, "no answer from the peers")
        self.resolved.append(await self.inner.resolve(attempt, timeout))
        return self.resolved[-1]


def latent_attention(model: FusedModel) -> FusedModel:
    """Give every layer of a DeepSeek-shaped ``FusedModel`` vLLM's own ``MLAAttention`` over its ``kv_b_proj``
    (``self_attn.mla_attn``, as vLLM nests it), and derive its ``W_UK_T``/``W_UV`` once, as vLLM's loader does.

    A real ``MLAAttention.__init__`` selects a CUDA attention backend: the layer is made without it, with the
    attributes its ``process_weights_after_loading`` reads (no backend packing, no quantisation)."""
    from vllm.model_executor.layers.attention import MLAAttention
    from vllm.model_executor.layers.attention.attention import set_default_quant_scales

    d = model.d
    for i in range(d.layers):
        attn = model.get_submodule(f"model.layers.{i}.self_attn")
        kv_b_proj = attn.get_submodule("kv_b_proj")
        kv_b_proj.quant_method = None  # an unquantised linear layer
        layer = MLAAttention.__new__(MLAAttention)
        torch.nn.Module.__init__(layer)
        layer.kv_b_proj = kv_b_proj
        layer.impl = SimpleNamespace(process_weights_after_loading=lambda dtype: None)
        layer.is_amx_bmm_enabled = layer.dcp_q_replicate = False
        layer.is_aiter_triton_fp4_bmm_enabled = layer.is_aiter_triton_fp8_bmm_enabled = False
        layer.kv_lora_rank, layer.num_heads = d.kv_lora_rank, model.nq
        layer.qk_nope_head_dim, layer.v_head_dim = d.head_dim, d.v_head_dim
        layer.quant_config, layer.layer_name = None, f"model.layers.{i}.self_attn.mla_attn"
        set_default_quant_scales(layer, register_buffer=True)
        attn.add_module("mla_attn", layer)
        with torch.no_grad():
            layer.process_weights_after_loading(torch.bfloat16)
    return model


def absorbed(model: FusedModel) -> dict[str, torch.Tensor]:
    """The ``W_UK_T``/``W_UV`` vLLM derives from each layer's ``kv_b_proj`` (``split_kv_b_proj`` and the
    transposes of ``process_weights_after_loading``), computed here by hand; none for a model without MLA."""
    d, out = model.d, {}
    for name, p in model.named_parameters():
        if name.endswith("self_attn.kv_b_proj.weight"):
            at = name.removesuffix("kv_b_proj.weight") + "mla_attn."
            w = p.detach().T.reshape(d.kv_lora_rank, model.nq, d.head_dim + d.v_head_dim)
            out[at + "W_UK_T"] = w[..., : d.head_dim].permute(1, 2, 0)
            out[at + "W_UV"] = w[..., d.head_dim :].transpose(0, 1)
    return out


def make_engine(kind: str, tp: int, rank: int, model: torch.nn.Module | None = None,
                fill: float = SENTINEL) -> tuple[Any, FusedModel]:  # fmt: skip
    """Build one worker's engine the way vLLM's worker does: plugins loaded, then the factory."""
    from vllm.config import DeviceConfig, ParallelConfig, VllmConfig
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory

    from refitflow.integrations.vllm.server.plugin import register

    register()  # the hook vLLM's plugin loader runs in every process (its discovery: test_vllm_backend)
    vc = VllmConfig(
        parallel_config=ParallelConfig(tensor_parallel_size=tp, rank=rank), device_config=DeviceConfig(device="cpu"),
        weight_transfer_config=WeightTransferConfig(backend="refitflow"),
    )  # fmt: skip
    # a real ModelConfig inspects vLLM's model class, which needs its CUDA kernels: this stand-in carries the
    # real transformers config, which is all the backend reads from it
    vc.model_config = SimpleNamespace(hf_config=config(kind), dtype=torch.bfloat16)
    if model is None:
        model = FusedModel(dims(kind), tp, rank, fill=fill)
        if kind == "deepseek":
            latent_attention(model)
    engine = WeightTransferEngineFactory.create_engine(vc.weight_transfer_config, vc, torch.device("cpu"), model)
    return engine, model  # type: ignore[return-value]


def expected(kind: str, seed: int, tp: int, rank: int) -> dict[str, torch.Tensor]:
    """What rank ``rank`` must hold after committing version ``seed``: the HF-named tensors loaded by the
    stand-in's own ``load_weights`` (written from vLLM's rules, not from refitflow's tables); the padding
    rows keep ``SENTINEL``; a DeepSeek model's ``W_UK_T``/``W_UV`` derived from its ``kv_b_proj``."""
    model = FusedModel(dims(kind), tp, rank)
    family = "block_sparse_moe" if kind == "mixtral" else "mlp"
    model.load_weights(p for n, t in canonical(kind, seed).items() for p in checkpoint_names(n, t, family))
    return {n: p.detach() for n, p in model.named_parameters()} | absorbed(model)


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
        report["vote"] = type(engine.session.member.channel).__name__
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
