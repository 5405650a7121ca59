"""The trainer's digest pass over the bench's synthetic model, in this process (no transport, no registry).

    python bench/digest_bench.py [--size-mb 512] [--rounds 5] [--ranks 2] [--loop SECONDS]

Prints, best of ``--rounds``: xxh3 of the model's bytes as one contiguous buffer (the hash alone);
the publisher's pass (``api.digesting._digest_all``: row-block and tile digests of every tensor) in one
thread, as ``Publisher`` runs it; the same pass split in two threads of about equal bytes (what the
publisher did before: python-xxhash keeps the GIL for inputs under ~100 KiB, so two threads take turns);
and the pass of ``Publisher(column_digests=False)`` (row blocks only: one contiguous pass).
One torch thread. ``--ranks 2``: every matrix as two row halves, the shards ``python -m bench``'s trainer
publishes (its two ranks). ``--loop SECONDS``: only the publisher's pass, over and over (best and median),
e.g. beside ``bench/nixl_ratio.py`` to see a refit and the trainer's digests share this machine.
GB/s = 10^9 bytes per second.
"""

from __future__ import annotations

import argparse
import threading
import time

import torch
import xxhash

from refitflow.api.digesting import _digest_all
from refitflow.cli.synthetic import synthetic_model


def best(rounds: int, fn: object) -> float:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-mb", type=float, default=512)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--ranks", type=int, default=1, help="cut every matrix into this many row ranges")
    ap.add_argument(
        "--loop",
        type=float,
        default=0.0,
        help="only run the publisher's pass, over and over, this many seconds (load beside a refit)",
    )
    a = ap.parse_args()
    torch.set_num_threads(1)
    model = synthetic_model(int(a.size_mb * 1e6))
    tensors = [part for t in model.values() for part in (t.chunk(a.ranks) if t.dim() >= 2 else (t,))]
    nbytes = sum(t.nbytes for t in tensors)
    flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors])
    items = [(t, "xxh3") for t in tensors]
    halves: tuple[list, list] = ([], [])
    load = [0, 0]
    for t in sorted(tensors, key=lambda t: -t.nbytes):  # largest first, each to the lighter half
        g = 0 if load[0] <= load[1] else 1
        halves[g].append((t, "xxh3"))
        load[g] += t.nbytes

    def two() -> None:
        threads = [threading.Thread(target=_digest_all, args=(h,)) for h in halves]
        for th in threads:
            th.start()
        for th in threads:
            th.join()

    if a.loop:
        times = []
        end = time.perf_counter() + a.loop
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            _digest_all(items)
            times.append(time.perf_counter() - t0)
        times.sort()
        print(f"publisher's digest pass over {nbytes / 1e9:.3f} GB, {len(times)} passes in {a.loop:g} s: "
              f"best {times[0] * 1e3:.1f} ms, median {times[len(times) // 2] * 1e3:.1f} ms")  # fmt: skip
        return
    print(f"{len(tensors)} bf16 shards ({a.ranks} per matrix), {nbytes / 1e9:.3f} GB, best of {a.rounds}")
    for name, fn in (("xxh3 of the bytes as one buffer", lambda: xxhash.xxh3_64_intdigest(flat.numpy().data)),
                     ("publisher's digest pass, one thread", lambda: _digest_all(items)),
                     ("the same pass, two threads", two),
                     ("rows only (column_digests=False)", lambda: _digest_all(items, columns=False))):  # fmt: skip
        s = best(a.rounds, fn)
        print(f"{name:<40} {s * 1e3:7.1f} ms  {nbytes / s / 1e9:6.2f} GB/s")


if __name__ == "__main__":
    main()
