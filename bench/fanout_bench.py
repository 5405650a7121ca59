"""Tree fan-out over NIXL: 1 trainer process, R receiver processes serving replicas, in waves.

    python bench/fanout_bench.py [--waves 1,1,2] [--tensors 64] [--numel 250000]

Every byte is counted by the agent it was actually read from (each READ notifies its owner of its
size: ``Transport.served_bytes``). Prints bytes per source, the trainer's egress in model copies,
and the fan-out factor: total bytes delivered / trainer egress.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import socket
import sys
import time

os.environ.setdefault("UCX_NET_DEVICES", "lo")

import anyio

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests" / "transports"))

from _nixl_peer import Peer
from _nixl_receiver import ReceiverProc

import refitflow as rf


def _address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


async def main(waves: list[int], tensors: int, numel: int) -> None:
    spec = {"tensors": tensors, "numel": numel, "model": "fanout-bench"}
    model_bytes = sum((numel + i % 7) * 4 for i in range(tensors))
    address, n = _address(), sum(waves)
    with anyio.fail_after(600):
        async with rf.Registry.serve(address) as server, Peer(spec) as trainer:
            await server.registry.publish(await trainer.publish(1, 7))
            receivers = [ReceiverProc(spec, address) for _ in range(n)]
            for r in receivers:
                await r.__aenter__()
            try:
                results: list[dict] = []
                t0, first = time.perf_counter(), 0
                for size in waves:
                    async with anyio.create_task_group() as tg:
                        for r in receivers[first : first + size]:
                            tg.start_soon(lambda r=r: _refit(results, r))
                    first += size
                took = time.perf_counter() - t0
                served = [await r.served() for r in receivers]
                delivered = n * model_bytes
                egress = await trainer.served()
                deadline = time.monotonic() + 5
                while egress + sum(served) < delivered and time.monotonic() < deadline:
                    await anyio.sleep(0.05)  # notifications may trail the last READ a little
                    egress = await trainer.served()
            finally:
                for r in receivers:
                    await r.__aexit__(None, None, None)
    assert all(res["exact"] for res in results), results
    print(f"{n} receivers in waves {waves}, model {model_bytes / 1e6:.1f} MB, {took:.2f} s, all bit-exact")
    print(f"  trainer egress: {egress / 1e6:8.1f} MB = {egress / model_bytes:.2f} model copies")
    for i, b in enumerate(served):
        print(f"  receiver {i} served: {b / 1e6:8.1f} MB = {b / model_bytes:.2f} model copies")
    total = egress + sum(served)
    print(f"  delivered {total / 1e6:.1f} MB (expected {delivered / 1e6:.1f}); fan-out factor {total / egress:.2f}")


async def _refit(results: list[dict], r: ReceiverProc) -> None:
    results.append(await r.refit(1, 7))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--waves", default="1,1,2", help="receivers refitting at once, wave by wave")
    parser.add_argument("--tensors", type=int, default=64)
    parser.add_argument("--numel", type=int, default=250_000)
    args = parser.parse_args()
    anyio.run(main, [int(w) for w in args.waves.split(",")], args.tensors, args.numel)
