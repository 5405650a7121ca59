"""How long a shadow commit takes at a step boundary: the swap a no-drain update makes between two steps.

    python bench/swap_bench.py [--tensors 1000] [--kb 64] [--rounds 20]

One receiver in shadow mode over ``--tensors`` tensors (in process, loopback transport: the pull is not what is
measured), each version prepared (pulled, verified), then committed; the commit is timed:

- ``shadow_commit="swap"``: the shadow storages become live by a pointer exchange per parameter (eager
  engines; what a vLLM server started with ``--enforce-eager`` can take);
- ``shadow_commit="copy"``: the shadows are copied into the live storage (every pointer stays: the path for
  captured CUDA graphs) — its copy time grows with the model.

Also timed: the storage check the vLLM backend runs after each commit (``kernels.StorageWatch.moved`` over every
parameter). Medians and worst of ``--rounds`` commits after a first.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import anyio
import torch

import refitflow as rf
from refitflow.integrations.vllm.worker.kernels import StorageWatch


async def commits(mode: str, args: argparse.Namespace) -> tuple[list[float], list[float], list[float]]:
    numel = args.kb * 1024 // 4
    trainer = {f"layers.{i}.weight": torch.randn(numel) for i in range(args.tensors)}
    model = torch.nn.Module()  # parameters named as the trainer's: the storage check matches them by name
    model.layers = torch.nn.ModuleList(torch.nn.Module() for _ in range(args.tensors))
    for layer in model.layers:
        layer.register_parameter("weight", torch.nn.Parameter(torch.zeros(numel), requires_grad=False))
    targets = dict(model.named_parameters())
    registry, ident = rf.Registry(), rf.Identity(model="swap-bench")
    watch = StorageWatch(model)
    seconds, swaps, checks = [], [], []
    async with (
        rf.Publisher(registry, identity=ident) as pub,
        rf.Receiver(
            targets, registry, identity=ident, mode="shadow", shadow_commit=mode, budget_bytes=64 << 20
        ) as recv,
    ):
        finish = recv.ledger.finish

        def timed(txn: Any) -> None:  # the pointer exchange (or, in copy mode, the bookkeeping after the copy)
            t0 = time.perf_counter()
            finish(txn)
            swaps.append(time.perf_counter() - t0)

        recv.ledger.finish = timed  # type: ignore[method-assign]
        for version in range(1, args.rounds + 2):
            for t in trainer.values():
                t.add_(1.0)
            await pub.publish(version, trainer)
            txn, _ = await recv.prepare(version, timeout=60)
            t0 = time.perf_counter()
            await recv.finish(txn)
            seconds.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            moved = watch.moved(recv.destination.live_pointers() if mode == "swap" else None)
            checks.append(time.perf_counter() - t0)
            assert not moved, moved
            await pub.released(version, timeout=10)
    assert all(torch.equal(targets[n], t) for n, t in trainer.items())
    return seconds[1:], swaps[1:], checks[1:]


async def run(args: argparse.Namespace) -> None:
    mb = args.tensors * args.kb / 1024
    print(f"{args.tensors} tensors, {mb:.0f} MiB; {args.rounds} commits after a first", flush=True)
    for mode in ("swap", "copy"):
        seconds, swaps, checks = await commits(mode, args)
        ms = lambda xs: f"median {statistics.median(xs) * 1e3:.3f} ms (worst {max(xs) * 1e3:.3f})"  # noqa: E731
        print(
            f"shadow_commit={mode}: swap {ms(swaps)}; whole finish {ms(seconds)}; storage check {ms(checks)}",
            flush=True,
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tensors", type=int, default=1000)
    p.add_argument("--kb", type=int, default=64)
    p.add_argument("--rounds", type=int, default=20)
    anyio.run(run, p.parse_args())


if __name__ == "__main__":
    main()
