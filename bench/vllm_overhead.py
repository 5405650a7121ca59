"""The vLLM backend's overhead over a bare ``Receiver.refit`` on the same bytes, in one run.

    python bench/vllm_overhead.py [--hidden 1024] [--layers 8] [--vocab 32000] [--rounds 5]

A Megatron-layout publisher (TP 1) and a registry served over ZMQ, in this process; reads over NIXL (the
backend is given the registry's address, as a vLLM server is, so loopback is not an option). Two models of
vLLM's fused names and shapes (the layout tables' ``fused`` layout: the vocabulary padded to 64 rows):
one refitted by a bare ``rf.Receiver`` over that layout, the other by the ``refitflow`` backend built by vLLM's
factory (``start_weight_update`` → ``update_weights`` → ``finish_weight_update``, called from a
thread as a worker calls them). Each round publishes a version for each, alternating which goes
first; the figures are wall seconds per version and the median overhead. Needs vLLM importable
(``.ci/engines-cpu.sh`` installs it on a CPU machine). GB/s = 10^9 bytes per second.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

os.environ.setdefault("UCX_NET_DEVICES", "lo")  # a benchmark script, like the CLI, may set the environment

import anyio
import anyio.to_thread
import torch
import transformers as tf

import refitflow as rf
from refitflow.integrations.hosting.fused_model import derive, parameters
from refitflow.layouts import Parallel, canonical_shapes, fused, megatron
from refitflow.layouts.canonical import from_canonical
from refitflow.layouts.hf import dims_from_config
from refitflow.layouts.wire import layout_metadata

TRANSPORT = "nixl"


def _module(shapes: dict[str, tuple[int, ...]]) -> torch.nn.Module:
    """A module whose parameters carry these dotted names (vLLM's), bf16."""
    root = torch.nn.Module()
    for dotted, shape in shapes.items():
        *path, leaf = dotted.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, torch.nn.Module())
            module = getattr(module, part)
        module.register_parameter(leaf, torch.nn.Parameter(torch.zeros(shape, dtype=torch.bfloat16), False))
    return root


def _engine(hf_config: Any, model: torch.nn.Module) -> Any:
    from vllm.config import DeviceConfig, ParallelConfig, VllmConfig
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory

    from refitflow.integrations.vllm.server.plugin import register

    register()
    vc = VllmConfig(parallel_config=ParallelConfig(), device_config=DeviceConfig(device="cpu"),
                    weight_transfer_config=WeightTransferConfig(backend="refitflow"))  # fmt: skip
    # what the backend reads of vLLM's model config (a real ModelConfig inspects vLLM's CUDA model classes)
    vc.model_config = SimpleNamespace(hf_config=hf_config, dtype=torch.bfloat16)
    return WeightTransferEngineFactory.create_engine(vc.weight_transfer_config, vc, torch.device("cpu"), model)


async def main(args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    hf_config = tf.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=16, num_key_value_heads=4,
    )  # fmt: skip
    d = dims_from_config(hf_config)
    canon = {n: torch.randn(s).to(torch.bfloat16) for n, s in canonical_shapes(d).items()}
    shards = from_canonical(megatron.layout(d, Parallel()), canon)
    layout = fused.layout_for(hf_config, fused.parallel(tp=1, tp_rank=0))  # vLLM's names, vocabulary padded to 64
    shapes = {n: lt.shape for n, lt in layout.items()}
    bare_model, engine_model = _module(shapes), _module(shapes)
    nbytes = sum(t.numel() * t.element_size() for t in shards.values())
    ident = rf.Identity(model="bench-vllm", layout="megatron")
    keys = rf.DeploymentKeys.create(Path(tempfile.mkdtemp(prefix="bench-keys-")))  # CURVE, as deployed
    os.environ["REFITFLOW_KEYS"] = str(keys.folder)  # where the engine (an integration) finds them
    async with rf.Registry.serve("tcp://127.0.0.1:*", security=keys.server) as server:
        async with rf.Publisher(server.registry, identity=ident, transport=TRANSPORT,
                                metadata=layout_metadata("megatron", d, Parallel())) as pub:  # fmt: skip
            derived = derive(parameters(bare_model), layout)
            engine = await anyio.to_thread.run_sync(_engine, hf_config, engine_model)
            info = engine.parse_init_info({
                "registry": server.address, "model": "bench-vllm", "identity": {"layout": "megatron"},
                "transport": TRANSPORT, "budget_bytes": args.budget_mb << 20})  # fmt: skip
            await anyio.to_thread.run_sync(engine.init_transfer_engine, info)  # blocking: the registry is on this loop
            async with rf.Receiver(derived.targets, server.address, identity=ident, transport=TRANSPORT,
                                   layout=derived.layout, budget_bytes=args.budget_mb << 20,
                                   security=keys) as recv:  # fmt: skip

                async def bare(v: int) -> float:
                    t0 = time.perf_counter()
                    await recv.refit(v, timeout=60)
                    return time.perf_counter() - t0

                def backend(v: int) -> float:
                    t0 = time.perf_counter()
                    engine.start_weight_update()
                    engine.update_weights({"version": v, "timeout_s": 120})
                    engine.finish_weight_update()
                    return time.perf_counter() - t0

                times: dict[str, list[float]] = {"bare": [], "backend": []}
                version = 0
                for i in range(args.rounds + 1):  # round 0 builds the plans: not counted
                    for who in ("bare", "backend") if i % 2 else ("backend", "bare"):
                        version += 1
                        for t in shards.values():  # new bytes everywhere: unchanged ones would not be pulled
                            t.add_(1)
                        await pub.publish(version, shards)
                        t = await bare(version) if who == "bare" else await anyio.to_thread.run_sync(backend, version)
                        if i:
                            times[who].append(t)
            await anyio.to_thread.run_sync(engine.shutdown)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"model {nbytes / 1e6:.1f} MB ({args.layers} layers, hidden {args.hidden}, vocab {args.vocab}), "
          f"transport {TRANSPORT}, {args.rounds} rounds")  # fmt: skip
    for who, ts in times.items():
        print(f"  {who:8s} median {med[who] * 1e3:8.1f} ms  {nbytes / med[who] / 1e9:6.2f} GB/s  "
              f"all: {' '.join(f'{t * 1e3:.0f}' for t in ts)} ms")  # fmt: skip
    over = med["backend"] - med["bare"]
    print(f"  backend overhead: {over * 1e3:+.1f} ms per version ({over / med['bare'] * 100:+.1f} %)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--budget-mb", type=int, default=64)
    anyio.run(main, parser.parse_args())
