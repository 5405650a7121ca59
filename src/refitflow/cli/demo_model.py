"""The demo on a real model: a tiny, randomly initialised transformers Llama, trained a step per version.

The trainer holds its weights in Megatron's layout at TP 2 (two publisher ranks, in one process) and
publishes each version; two engines in vLLM's fused layout — one at TP 1 (in place), one at TP 2
(shadow, its ranks committing together through an engine vote) — refit every version, each rank
reading only its own slice. After each version every engine's logits on a fixed prompt are compared
with the trainer's. Every name and shape comes from the layout tables (``layouts.megatron``,
``layouts.fused``, ``layouts.hf``), never from this file.
"""

from __future__ import annotations

import contextlib
import functools
import tempfile
import threading
import time
from typing import Any

import anyio
import torch

from refitflow.api.publisher import Publisher
from refitflow.api.receiver import Receiver
from refitflow.cli.demo_roles import ProgressMetrics, Report, RoleConfig, publish_all, refit_event, wait_for_receivers
from refitflow.core.errors import ConfigError, RefitError
from refitflow.core.types import Identity, Publication
from refitflow.engine.member import EngineMember
from refitflow.engine.zmq_vote import ZmqVote
from refitflow.layouts import Parallel, canonical_shapes, fused, hf, megatron
from refitflow.layouts.canonical import from_canonical, to_canonical
from refitflow.layouts.wire import layout_metadata
from refitflow.registry.keys import client_of, server_of

__all__ = ["ENGINES", "IDENTITY", "TRAIN_TP", "engine_role", "model_nbytes", "require_transformers", "trainer_role"]

# a tiny Llama (about 6.6 MB in bf16): GQA, untied head; every size divisible by both TPs
CONFIG: dict[str, Any] = dict(
    vocab_size=1024, hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=8,
    num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False,
)  # fmt: skip
TRAIN_TP = 2
ENGINES = (("tp1", 1, "in_place"), ("tp2", 2, "shadow"))  # name, TP, apply mode
IDENTITY = Identity(model="demo-tiny-llama", layout="megatron", dtype="bfloat16", parallelism=f"tp{TRAIN_TP}")
DTYPE = torch.bfloat16


def require_transformers() -> None:
    """A ``ConfigError`` naming the fix when transformers is missing."""
    try:
        import transformers  # noqa: F401
    except ImportError as exc:
        raise ConfigError(
            "the demo's model needs transformers: pip install 'refitflow[demo]' (or run --model synthetic)"
        ) from exc


@functools.cache
def _config() -> Any:
    import transformers

    return transformers.LlamaConfig(**CONFIG)


def _dims() -> Any:
    return hf.dims_from_config(_config())


def model_nbytes() -> int:
    """Bytes of the whole model in the demo's dtype."""
    item = torch.empty((), dtype=DTYPE).element_size()
    return sum(torch.Size(s).numel() for s in canonical_shapes(_dims()).values()) * item


def _canonical(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    d = _dims()
    state = {n: t.detach() for n, t in model.state_dict().items()}
    return to_canonical([(hf.layout(d), state)], canonical_shapes(d))


@functools.cache
def _probe_model() -> torch.nn.Module:
    import transformers

    return transformers.LlamaForCausalLM(_config()).float().eval()


_PROBE_LOCK = threading.Lock()  # one probe model per process; with --transport loopback, roles share it


def probe_logits(canonical: dict[str, torch.Tensor]) -> torch.Tensor:
    """Logits on a fixed prompt of the model made of ``canonical`` weights (one fp32 forward, same on every side)."""
    weights = {n: t.float() for n, t in from_canonical(hf.layout(_dims()), canonical).items()}
    ids = (torch.arange(32).reshape(2, 16) * 37) % CONFIG["vocab_size"]
    with _PROBE_LOCK, torch.no_grad():
        model = _probe_model()
        model.load_state_dict(weights)
        return model(input_ids=ids).logits


def _train_step(model: torch.nn.Module, gen: torch.Generator) -> None:
    """One real optimiser step on a random batch (next-token loss), in place."""
    ids = torch.randint(0, CONFIG["vocab_size"], (4, 32), generator=gen)
    model.zero_grad()
    model(input_ids=ids, labels=ids).loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.add_(p.grad, alpha=-0.5)


async def trainer_role(registry: Any, cfg: RoleConfig, receivers: int, report: Report) -> None:
    """Two Megatron ranks (TP 2) of one trainer: a training step, then a publish, per version."""
    import transformers

    torch.manual_seed(0)
    model: torch.nn.Module = transformers.LlamaForCausalLM(_config())
    model = model.to(DTYPE)
    d, gen = _dims(), torch.Generator().manual_seed(1)
    pars = [Parallel(tp=TRAIN_TP, tp_rank=r) for r in range(TRAIN_TP)]
    maps = [megatron.layout(d, p) for p in pars]
    canon = _canonical(model)
    shards = [from_canonical(m, canon) for m in maps]  # the ranks' own parameters, in Megatron's layout
    async with contextlib.AsyncExitStack() as stack:
        pubs = []
        for r, p in enumerate(pars):
            pub = Publisher(registry, identity=IDENTITY, rank=r, world_size=TRAIN_TP, transport=cfg.transport,
                            metadata=layout_metadata("megatron", d, p), security=cfg.security(registry))  # fmt: skip
            pubs.append(await stack.enter_async_context(pub))
        await wait_for_receivers(pubs[0], receivers, cfg.timeout_s)
        report({"kind": "publisher_ready", "tensors": sum(len(s) for s in shards), "nbytes": model_nbytes(),
                "ranks": TRAIN_TP, "sample": sorted(maps[0])[:2]})  # fmt: skip
        for version in range(1, cfg.versions + 1):
            if version > 1:
                await pubs[0].released(version - 1, timeout=cfg.timeout_s)
                await anyio.to_thread.run_sync(_train_step, model, gen)
                canon = _canonical(model)
                for mine, layout in zip(shards, maps, strict=True):  # each rank's slice of the new weights
                    for name, t in from_canonical(layout, canon).items():
                        mine[name].copy_(t)
            t0 = time.perf_counter()
            early = pubs[0].announces_early  # auto: once a version changed (nearly) every byte
            manifests = await publish_all(pubs, shards, version, at_once=early)
            seconds = time.perf_counter() - t0
            revision = Publication(identity=IDENTITY, version=version, manifests=tuple(manifests)).revision
            report({"kind": "published", "version": version, "revision": revision, "seconds": seconds,
                    "early": early})  # fmt: skip
            logits = await anyio.to_thread.run_sync(probe_logits, canon)
            report({"kind": "trainer_logits", "version": version, "logits": logits})
        await pubs[0].released(cfg.versions, timeout=cfg.timeout_s)


async def engine_role(name: str, tp: int, mode: str, registry: Any, cfg: RoleConfig, report: Report) -> None:
    """One engine of ``tp`` ranks in the fused layout; its ranks commit each version together (ZMQ vote)."""
    d = _dims()
    maps = [fused.layout(d, Parallel(tp=tp, tp_rank=r)) for r in range(tp)]
    params = [{n: torch.zeros(lt.shape, dtype=DTYPE) for n, lt in m.items()} for m in maps]
    names = [f"{name}/r{r}" if tp > 1 else name for r in range(tp)]
    metrics = [ProgressMetrics(n, report) for n in names]
    with tempfile.TemporaryDirectory(prefix="refitflow-vote-") as tmp:
        votes = [f"ipc://{tmp}/rank{r}" for r in range(tp)]
        async with contextlib.AsyncExitStack() as stack:
            members = []
            for r in range(tp):
                stack.callback(metrics[r].close)
                recv = await stack.enter_async_context(Receiver(
                    params[r], registry, identity=IDENTITY, transport=cfg.transport, mode=mode, layout=maps[r],
                    budget_bytes=cfg.budget_bytes, observer=metrics[r], receiver_id=f"demo-{names[r]}",
                    security=cfg.security(registry),
                ))  # fmt: skip
                vote = await stack.enter_async_context(ZmqVote(
                    r, votes, group=name, server_security=server_of(cfg.keys),
                    client_security=client_of(cfg.keys, "rollout"),
                ))  # fmt: skip
                members.append(EngineMember(recv, vote, vote_timeout=cfg.timeout_s))
                report({"kind": "receiver_ready", "name": names[r], "metrics_port": metrics[r].serve(),
                        "total": sum(t.nbytes for t in params[r].values())})  # fmt: skip
            for version in range(1, cfg.versions + 1):
                outcomes: list[Any] = [None] * tp

                async def one(r: int, version: int = version, outcomes: list[Any] = outcomes) -> None:
                    metrics[r].new_refit()
                    outcomes[r] = await members[r].refit(version, timeout=cfg.timeout_s)

                async with anyio.create_task_group() as tg:
                    for r in range(tp):
                        tg.start_soon(one, r)
                for r, outcome in enumerate(outcomes):
                    if outcome.error is not None:
                        raise outcome.error
                    if outcome.result is None:
                        raise RefitError(f"{names[r]}: the engine vote decided {outcome.decision}", version=version)
                    report(refit_event(names[r], outcome.result, members[r].receiver, outcome.committed))
                canon = to_canonical(list(zip(maps, params, strict=True)), canonical_shapes(d))
                logits = await anyio.to_thread.run_sync(probe_logits, canon)
                report({"kind": "engine_logits", "engine": name, "tp": tp, "version": version, "logits": logits,
                        "decision": str(outcomes[0].decision)})  # fmt: skip
