"""Manifest wire cost: bytes → checked ``Manifest`` (every hop: the registry, every receiver), against an earlier
refitflow, in the same run.

    python bench/manifest_bench.py [--shards 10000] [--baseline 1680af6] [--rounds 5]

One trainer rank's manifest of ``--shards`` tensors as a Megatron rank of a MoE model publishes it: names of
experts layer by layer, bf16 slices of one row range, 2-D tile digests (random values, as real digests are),
one region each. Both sides build the same manifest with their own code and time, best of ``--rounds``:
``encode`` (Manifest → bytes), ``parse`` (bytes → checked Manifest: JSON, every spec's checks, the revision),
and the two-phase completion message (the digests alone where the baseline sends the whole manifest again).
The baseline is the source tree of ``--baseline`` (``git archive``), run in a subprocess beside this one.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import timeit

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from _tree import source_of  # noqa: E402


def measure(shards: int, rounds: int) -> dict[str, float]:
    """This interpreter's refitflow: seconds per shard and bytes of one manifest."""
    import base64
    import random

    import torch

    import refitflow as rf
    from refitflow.api.digesting import digest
    from refitflow.core import wire

    rng = random.Random(0)
    fields = digest(torch.zeros(4, 7168, dtype=torch.bfloat16))  # a rank's 4 × 7168 slice: its tile geometry
    blocks = len(base64.b64decode(fields["blocks"])) if fields["blocks"] else 0
    specs = []
    for t in range(shards):
        layer, expert, part = t // 384, (t // 3) % 128, ("w1", "w2", "w3")[t % 3]
        raw = rng.randbytes(blocks)
        specs.append(rf.ShardSpec(
            name=f"decoder.layers.{layer}.mlp.experts.local_experts.{expert}.linear_fc.{part}.weight",
            dtype="bfloat16", global_shape=(32, 7168), axis=0, start=4, stop=8, region=t,
            **{**fields, "blocks": base64.b64encode(raw).decode() if raw else "", "digest": rng.randbytes(8).hex()},
        ))  # fmt: skip
    source = rf.SourceAddress(transport="nixl", agent="trainer-1", metadata=rng.randbytes(2048))
    m = rf.Manifest(identity=rf.Identity(model="bench"), version=7, rank=1, world_size=8, source=source,
                    shards=tuple(specs), metadata={"layout": '{"kind": "megatron"}'})  # fmt: skip
    data = wire.encode(wire.manifest_to_dict(m))
    assert wire.manifest_from_dict(wire.decode(data)) == m

    def best(fn: object) -> float:
        return min(timeit.repeat(fn, number=1, repeat=rounds)) / shards  # type: ignore[arg-type]

    out = {
        "bytes": len(data),
        "encode": best(lambda: wire.encode(wire.manifest_to_dict(m))),
        "parse": best(lambda: wire.manifest_from_dict(wire.decode(data))),
    }
    if hasattr(wire, "digests_to_dict"):  # the two-phase completion: the digests alone
        pending = wire.manifest_from_dict(wire.decode(data))
        pending = dataclasses.replace(m, revision="", shards=tuple(
            type(s)(**{**vars(s), "digest": "", "blocks": ""}) for s in pending.shards))  # fmt: skip
        done = wire.encode(wire.digests_to_dict(m))
        out["completion_bytes"] = len(done)
        out["completion"] = best(lambda: wire.manifest_completed(pending, wire.decode(done)))
    else:  # the whole manifest again
        out["completion_bytes"], out["completion"] = out["bytes"], out["parse"]
    return out


def baseline(commit: str, shards: int, rounds: int) -> dict[str, float]:
    with source_of(commit) as src:
        code = (f"import sys, json; sys.path.insert(0, {str(ROOT / 'bench')!r}); import manifest_bench as b; "
                f"print(json.dumps(b.measure({shards}, {rounds})))")  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(src)}
        run = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, env=env)
        return dict(json.loads(run.stdout.strip().splitlines()[-1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shards", type=int, default=10_000)
    ap.add_argument("--baseline", default="1680af6", help="the earlier refitflow (a git commit; '': none)")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    after = measure(args.shards, args.rounds)
    before = baseline(args.baseline, args.shards, args.rounds) if args.baseline else after
    print(f"one manifest of {args.shards} shards; µs a shard (best of {args.rounds}); load {os.getloadavg()[0]:.2f}")
    print(f"{'':28}{args.baseline:>14}{'this tree':>14}{'ratio':>8}")
    for key, label, unit in (("parse", "parse (bytes → Manifest)", 1e6), ("encode", "encode", 1e6),
                             ("completion", "completion parse", 1e6), ("bytes", "manifest bytes", 1),
                             ("completion_bytes", "completion bytes", 1)):  # fmt: skip
        b, a = before[key] * unit, after[key] * unit
        print(f"{label:28}{b:>14.2f}{a:>14.2f}{b / a:>7.1f}×")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "src"))
    main()
