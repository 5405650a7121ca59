"""The processes of a stream test: one sender (group rank 0) and receivers (ranks 1, 2) forming one
engine, each in its own process. The stream group is built by ``rf.stream_group``; the receivers'
engine vote runs over a gloo group of their own (as an inference engine's TP group would).

A *script* is a list of steps ``(kind, version)``; every process walks the same script:

- ``good``: the sender streams the weights of ``version``;
- a case of ``_frames.CASES``: the sender streams that malformed stream;
- ``refuse``: a good stream, which receiver 2 refuses (it asks for a newer version);
- ``fail``: a good stream; receiver 1's apply stage fails on its first bucket;
- ``oversize``: the sender sends one header announcing a 2**63-1 byte payload, then the rest;
- ``llama``: the sender streams a transformers Llama's HF state dict, receivers hold fused TP-2 shards.
"""

from __future__ import annotations

import datetime
import os
import time
import traceback
from typing import Any

import anyio
import torch

import refitflow as rf
from refitflow.metrics.prometheus import PrometheusMetrics
from refitflow.push.format import CMD_BUCKET, Header
from tests.push import _frames

GROUP_TIMEOUT_S = 20.0


def llama() -> Any:
    import transformers as tf

    torch.manual_seed(7)
    cfg = tf.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False)  # fmt: skip
    return tf.LlamaForCausalLM(cfg).to(torch.bfloat16)


LLAMA_BUCKET_BYTES = 9000  # q_proj (8 KiB) fills a bucket: k_proj and v_proj of a layer travel in the next


class Switch(PrometheusMetrics):
    """Metrics that can also fail this rank's apply stage on purpose (a real failure inside the stage)."""

    armed = False

    def stage_item(self, stage: str, nbytes: int, seconds: float) -> None:
        super().stage_item(stage, nbytes, seconds)
        if self.armed and stage == "apply":
            self.armed = False
            raise RuntimeError("injected apply failure")


async def _send(group: rf.StreamGroup, script: list[tuple[str, int]]) -> list[dict[str, Any]]:
    sender = rf.StreamSender(group, bucket_bytes=_frames.BUCKET_BYTES)
    out = []
    for kind, version in script:
        try:
            if kind == "llama":
                state = llama().state_dict()
                await rf.StreamSender(group, bucket_bytes=LLAMA_BUCKET_BYTES).send(version, state)
            elif kind in _frames.CASES:
                await anyio.to_thread.run_sync(
                    _frames.send, group, _frames.malformed(kind, version, _frames.weights(version))
                )
            elif kind == "oversize":
                frames = [
                    _frames.Frame(Header(CMD_BUCKET, 0, 2**63 - 1, version)),
                    *_frames.good(version, _frames.weights(version)),
                ]
                await anyio.to_thread.run_sync(_frames.send, group, frames[:1])  # the rest can never be received
                await anyio.to_thread.run_sync(_frames.send, group, frames[1:])
            else:
                await sender.send(version, _frames.weights(version))
            out.append({"kind": kind, "version": version, "ok": True})
        except rf.RefitError as exc:
            out.append(
                {"kind": kind, "version": version, "ok": False, "error": type(exc).__name__, "message": str(exc)}
            )
            break
    return out


def _serves(model: dict[str, torch.Tensor], candidates: list[int]) -> int | None:
    """Which version's weights the rank holds bit-exactly (-1: its initial ones; None: none of them)."""
    for v in candidates:
        if all(torch.equal(model[n].detach(), t) for n, t in _frames.weights(v).items()):
            return v
    return None


async def _receive(rank: int, group: rf.StreamGroup, script: list[tuple[str, int]], opts: dict) -> list[dict[str, Any]]:
    metrics = Switch()
    mode = "in_place" if rank == 1 else "shadow"
    if script[0][0] == "llama":
        return await _receive_llama(rank, group, script, mode)
    model = _frames.server(rank)
    params = dict(model.named_parameters())
    initial = {n: p.detach().clone() for n, p in params.items()}
    recv = rf.StreamReceiver(model, group, mode=mode, observer=metrics, budget_bytes=opts.get(rank, 1 << 20))
    member = rf.EngineMember(recv, rf.GlooVote(), vote_timeout=15)
    out, committed = [], -1
    for kind, version in script:
        metrics.armed = kind == "fail" and rank == 1
        floor = version + 1 if kind == "refuse" and rank == 2 else None
        outcome = await member.refit(floor, timeout=60)
        if outcome.committed:
            committed = version
        held = _serves(params, [version, committed] if committed >= 0 else [version])
        if held is None and all(torch.equal(params[n].detach(), t) for n, t in initial.items()):
            held = -1
        err = outcome.error
        out.append({
            "kind": kind, "version": version, "decision": outcome.decision.value, "committed": outcome.committed,
            "error": type(err).__name__ if err else None, "message": str(err) if err else None,
            "error_kind": getattr(err, "kind", None), "fence": recv.fence.state.value, "serves": held,
            "left_group": group.closed, "mode": mode,
            "refused": {k: metrics.registry.get_sample_value("refitflow_stream_frames_refused_total", {"kind": k})
                        for k in ("entry", "metadata", "header", "command", "ceiling", "version")},
        })  # fmt: skip
        if group.closed:
            break
    return out


async def _receive_llama(rank: int, group: rf.StreamGroup, script: list[tuple[str, int]], mode: str) -> list[dict]:
    from refitflow.layouts import Parallel, canonical_shapes, fused, hf
    from refitflow.layouts.canonical import from_canonical, to_canonical

    trainer = llama()
    d = hf.dims_from_config(trainer.config)
    layout = fused.layout(d, Parallel(tp=2, tp_rank=rank - 1))
    tensors = {n: torch.zeros(lt.shape, dtype=torch.bfloat16) for n, lt in layout.items()}
    recv = rf.StreamReceiver(tensors, group, mode=mode, layout=layout, budget_bytes=1 << 20)
    outcome = await rf.EngineMember(recv, rf.GlooVote(), vote_timeout=15).refit(timeout=60)
    expected = from_canonical(layout, to_canonical([(hf.layout(d), trainer.state_dict())], canonical_shapes(d)))
    exact = all(torch.equal(recv.destination.params[n].detach(), t) for n, t in expected.items())
    return [{"kind": "llama", "version": script[0][1], "committed": outcome.committed, "exact": exact,
             "fused": sorted(n for n in layout if "qkv_proj" in n or "gate_up_proj" in n),
             "error": repr(outcome.error) if outcome.error else None}]  # fmt: skip


def run(rank: int, ports: tuple[int, int], script: list[tuple[str, int]], opts: dict, queue: Any) -> None:
    """One process: join the stream group (and, for receivers, the engine's vote group), walk the script.

    ``opts``: receiver rank -> its budget in bytes (default 1 MiB).
    """
    torch.set_num_threads(1)
    try:
        group = rf.stream_group(f"127.0.0.1:{ports[0]}", world_size=3, rank=rank, timeout_s=GROUP_TIMEOUT_S)
        if rank == 0:
            report = anyio.run(_send, group, script)
        else:
            import torch.distributed as dist

            dist.init_process_group(
                "gloo", init_method=f"tcp://127.0.0.1:{ports[1]}", rank=rank - 1, world_size=2,
                timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S),
            )  # fmt: skip
            report = anyio.run(_receive, rank, group, script, opts)
        queue.put((rank, report))
    except BaseException:
        queue.put((rank, [{"crash": traceback.format_exc()}]))
    if rank > 0:  # the vote's store lives in rank 1: it leaves last, or a slower peer loses its last verdict
        _leave_together(rank - 1)
    queue.close()
    queue.join_thread()
    os._exit(0)  # a torn-down group may not be destroyed cleanly: do not wait in its destructor


def _leave_together(vote_rank: int) -> None:
    import torch.distributed as dist

    try:
        store = dist.group.WORLD.get_group_store()  # type: ignore[union-attr]
        store.add("left", 1)
        deadline = time.monotonic() + 30
        while vote_rank == 0 and int(store.add("left", 0)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    except Exception:  # a peer that crashed took nothing with it: leave anyway
        pass
