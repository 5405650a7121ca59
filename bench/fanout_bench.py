"""Pipelined fan-out and delta refits over NIXL: 1 trainer process, N receiver processes that relay.

    python bench/fanout_bench.py [--together 1,4,8] [--tensors 64] [--numel 250000] [--frozen 0.5] [--mode shadow]

Every version is new bytes. Versions 1 and 2 warm every receiver up (plans, connections, and the first write of
each of a shadow receiver's two storages — page faults, a relay's offer of each: a cost once in a receiver's life
that no later version pays), versions 3 and 4 the first receiver alone (the lone rows' receiver: its reads of the
whole trainer into each storage prepared once, as a receiver that reads the trainer every version has them);
then, for each k of
``--together``, a new version is refitted by k receivers started at the same moment: the row shows the
trainer's egress in model copies (counted by the trainer's agent: each READ of it notifies it of its
size), the bytes relayed (counted by their readers), each receiver's refit time (``RefitResult.seconds``:
found → prepared), the slowest against the lone receiver's of the same run (k = 1), and the seconds on a CPU of a
receiver's threads from the command to its answer (the mean over the row's receivers). ``--frozen f``:
one more version in which the first f of the tensors keep their bytes, refitted by one receiver (a delta
refit), against the lone full refit. ``--no-relay``: receivers that serve nobody (all read the trainer).
Prints the load average: on a machine shared with other work the seconds are noisy; the copies are not.
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

from _meter import thread_cpu_seconds
from _nixl_peer import Peer
from _nixl_receiver import ReceiverProc

import refitflow as rf


def _address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


async def _together(receivers: list[ReceiverProc], version: int, seed: int, **content: int) -> list[dict]:
    """Every receiver refits ``version`` at once; each result gets ``cpu_s``, the seconds on a CPU of all its
    threads meanwhile. Each checks its bytes only once all have refitted (making the expected model takes ≈ 0.1 s
    of both cores here: a receiver that checked as it finished would slow the refits still running — a chain of
    relays' later readers most)."""
    results: dict[int, dict] = {}
    pids = [r.proc.pid for r in receivers if r.proc is not None]
    before = [thread_cpu_seconds(pid) for pid in pids]

    async def one(i: int, r: ReceiverProc) -> None:
        results[i] = await r.refit(version, seed, later=True, **content)

    async with anyio.create_task_group() as tg:
        for i, r in enumerate(receivers):
            tg.start_soon(one, i, r)
    for i, (pid, cpu) in enumerate(zip(pids, before, strict=True)):
        results[i]["cpu_s"] = thread_cpu_seconds(pid) - cpu
    assert all(res["version"] == version for res in results.values()), results
    assert all([await r.check() for r in receivers]), f"a receiver's bytes are not version {version}'s"
    return [results[i] for i in range(len(receivers))]


async def _egress(trainer: Peer, before: int, owed: int) -> int:
    """Bytes the trainer served since ``before``, once they reach ``owed`` (NIXL notifications may trail the
    last READ a little: polled, another process) or after 5 s."""
    deadline = time.monotonic() + 5
    while True:
        egress = await trainer.served() - before
        if egress >= owed or time.monotonic() > deadline:
            return egress
        await anyio.sleep(0.05)


async def main(args: argparse.Namespace) -> None:
    together = [int(k) for k in args.together.split(",")]
    spec = {"tensors": args.tensors, "numel": args.numel, "model": "fanout-bench"}
    model_bytes = sum((args.numel + i % 7) * 4 for i in range(args.tensors))
    address, n = _address(), max(together)
    options = {"mode": args.mode, "serve": not args.no_relay, "relay_bucket_bytes": int(args.relay_bucket_mb * 2**20)}
    print(f"model {model_bytes / 1e6:.1f} MB in {args.tensors} tensors; {n} receiver processes ({args.mode}, "
          f"{'relaying' if not args.no_relay else 'not relaying'}); {os.cpu_count()} cores; "
          f"load average {os.getloadavg()[0]:.2f}")  # fmt: skip
    with anyio.fail_after(1200):
        async with rf.Registry.serve(address) as server, Peer(spec) as trainer:
            receivers = [ReceiverProc(spec, address, **options) for _ in range(n)]
            for r in receivers:
                await r.__aenter__()
            try:
                for version in (1, 2, 3, 4):  # warm-up (see the module's docstring)
                    await server.registry.publish(await trainer.publish(version, version))
                    await _together(receivers if version <= 2 else receivers[:1], version, version)
                lone = None
                print(f"{'together':>8} {'egress (copies)':>15} {'relayed MB':>10} {'mean s':>7} {'max s':>7} "
                      f"{'max / lone':>10} {'CPU ms a receiver':>17}")  # fmt: skip
                for k in together:
                    version += 1
                    await server.registry.publish(await trainer.publish(version, version))
                    before = await trainer.served()
                    results = await _together(receivers[:k], version, version)
                    relayed = sum(r["relay_bytes"] for r in results)  # counted by the readers
                    egress = await _egress(trainer, before, k * model_bytes - relayed)
                    seconds = [res["seconds"] for res in results]
                    if args.stages:
                        for res in results:
                            print("   ", res["seconds"], res["stages"])
                    lone = lone or max(seconds)
                    cpu = sum(r["cpu_s"] for r in results) / k
                    print(f"{k:>8} {egress / model_bytes:>15.2f} {relayed / 1e6:>10.1f} {sum(seconds) / k:>7.3f} "
                          f"{max(seconds):>7.3f} {max(seconds) / lone:>10.2f} {cpu * 1e3:>17.1f}")  # fmt: skip
                if args.frozen:
                    frozen = int(args.frozen * args.tensors)
                    version += 1
                    await server.registry.publish(await trainer.publish(version, version, frozen=frozen))
                    res = (await _together(receivers[:1], version, version, frozen=frozen, base=version - 1))[0]
                    share, skipped = res["nbytes"] / model_bytes, res["skipped_bytes"] / 1e6
                    print(f"delta refit, {frozen} of {args.tensors} tensors frozen: pulled {res['nbytes'] / 1e6:.1f} "
                          f"MB ({share:.2f} of the model), skipped {skipped:.1f} MB, {res['seconds']:.3f} s = "
                          f"{res['seconds'] / lone:.2f} of the lone full refit")  # fmt: skip
            finally:
                for r in receivers:
                    await r.__aexit__(None, None, None)
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--together", default="1,4,8", help="receivers starting at once, one version each")
    parser.add_argument("--tensors", type=int, default=64)
    parser.add_argument("--numel", type=int, default=250_000)
    parser.add_argument("--frozen", type=float, default=0.5, help="share of tensors frozen in the delta row (0: none)")
    parser.add_argument("--mode", default="shadow", choices=["shadow", "in_place"])
    parser.add_argument("--no-relay", action="store_true", help="receivers that serve nobody (the baseline)")
    parser.add_argument("--stages", action="store_true", help="print each receiver's stage table")
    parser.add_argument("--relay-bucket-mb", type=float, default=4.0, help="relays' bucket cap (relay_bucket_bytes)")
    anyio.run(main, parser.parse_args())
