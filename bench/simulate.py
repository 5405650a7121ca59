"""Refits at scale, simulated: refitflow's own planner, relay scheduler and registry decide who reads what
from whom and when; a fluid link model with max-min fair sharing decides how long it takes.

    python bench/simulate.py [--scenario kimi,dsv3,calib] [--relay on|off|both] [--no-relay]
        [--gpu-gbps 50] [--latency-us 10] [--gpus-per-host 8] [--host-gbps 0] [--switch-gbps 0]
        [--verify-gbps 20] [--trainer-digest-gbps 10.7] [--bucket-us 350] [--relay-bucket-us 1900]
        [--read-us 2.8] [--registry-rtt-ms 0.5] [--registry-gbps 12.5] [--registry-s S] [--fetch-s S]
        [--plan-s 0] [--commit-ms 1] [--announce-early] [--relay-bucket-mb 4] [--segments 128]
        [--what-if] [--svg docs/scale.svg] [--cache DIR] [--fit]

Every parameter is a field of ``_sim_model.Params`` (its comments say what each is); docs/scale.md says
what the model leaves out and how it was calibrated.

Scenarios (``_sim_setups``): ``kimi`` — Kimi-K2, Megatron TP8 × EP32 × PP8 (256 GPUs) → 8 vLLM engines
of EP16 (128 GPUs); ``dsv3`` — DeepSeek-V3, Megatron PP16 × EP16 (256 GPUs) → 8 vLLM engines of TP32
(256 GPUs); ``calib`` — the runs of ``bench/fanout_bench.py`` on this machine, predicted against measured;
``flat`` — ``--tensors`` float32 tensors of ``--numel`` elements, one trainer rank, ``--receivers``
receivers (tests). Each prints time to all committed, where the last engine's slowest rank spent it
(the bound), each resource's lower bound, the trainer's egress in model copies (one copy: what one
engine reads) and the largest relay egress.
``--what-if`` adds rows for changes refitflow does not have; ``--svg`` plots time against GPU NIC bandwidth.

Plans are the real ones, one per rank of one engine (engines are replicas), cached under ``--cache``
(reductions only, keyed by the planner's source); the per-version registry and fetch costs are measured
here (``_sim_costs``) unless given.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import _sim_setups as setups
from _sim_calib import calibration
from _sim_costs import Costs, measure
from _sim_model import Params, Result, simulate
from _sim_svg import plot
from _sim_traffic import Classes, Setup, plan_classes

__all__ = ["WHAT_IF", "Run", "ladder", "main"]

MiB = 1 << 20
# what refitflow does not do (or not by default), cumulative: each row keeps the changes above it;
# (name, change, which runs: "relay", "pull" or "both")
WHAT_IF: list[tuple[str, dict[str, object], str]] = [
    ("relay_bucket_bytes 64 MiB (an option today)", {"relay_bucket_mb": 64.0}, "relay"),
    ("announce early (an option today)", {"announce_early": True}, "pull"),
    ("read_start spread per engine (an option today; VllmFleet.init sets it)", {"rotate": True}, "pull"),
    ("digests on the device, 1 TB/s (verify, trainer)", {"verify_gbps": 1000.0, "trainer_digest_gbps": 1000.0},
     "both"),
    ("per-bucket costs 50 us (relayed buckets too)", {"bucket_us": 50.0, "relay_bucket_us": 50.0}, "both"),
    ("NIXL descriptors prepared once per plan, 0.3 us each", {"read_us": 0.3}, "both"),
    ("fp8 on the wire (half the bytes)", {"byte_scale": 0.5}, "both"),
]  # fmt: skip


@dataclasses.dataclass
class Run:
    """One scenario's inputs: the setup, its planned classes (by relaying and relay bucket), measured costs."""

    setup: Setup
    costs: Costs
    bucket: int
    cache: pathlib.Path | None
    classes: dict[tuple[bool, int], Classes] = dataclasses.field(default_factory=dict)

    def planned(self, relay: bool, bucket: int | None = None) -> Classes:
        key = (relay, (bucket or self.bucket) if relay else 0)
        if key not in self.classes:
            self.classes[key] = plan_classes(self.setup, relay, key[1] or self.bucket, self.cache)
        return self.classes[key]

    def sim(self, p: Params, relay: bool, changes: dict[str, object] | None = None) -> Result:
        """``p`` with ``changes`` (Params fields, and ``relay_bucket_mb``) for this run."""
        ch = dict(changes or {})
        mb = ch.pop("relay_bucket_mb", None)
        q = dataclasses.replace(p, **ch)  # type: ignore[arg-type]
        cls = self.planned(relay, int(float(mb) * MiB) if mb else None)  # type: ignore[arg-type]
        reg = self.costs.registry_s if q.registry_s is None else min(q.registry_s, self.costs.registry_s)
        fetch = self.costs.fetch_s(cls.part_digests) if q.fetch_s is None else q.fetch_s
        return simulate(cls, q, registry_s=reg, fetch_s=fetch, wire_bytes=self.costs.wire_bytes(cls.part_digests),
                        engines=self.setup.engines, relay=relay)  # fmt: skip


def ladder(relay: bool) -> list[tuple[str, dict[str, object]]]:
    """The what-if rows for one mode, cumulative."""
    rows, acc = [], {}
    for name, change, mode in WHAT_IF:
        if mode in ("both", "relay" if relay else "pull"):
            acc = acc | change
            rows.append((name, dict(acc)))
    return rows


def _row(name: str, res: Result, relay: bool) -> str:
    top = sorted(res.phases.items(), key=lambda kv: -kv[1])[:3]
    where = "; ".join(f"{k} {v:.2f}" for k, v in top)
    return (f"| {name} | {'relay' if relay else 'no relay'} | **{res.committed:.2f}** | {where} | "
            f"{res.trainer_egress / res.engine_bytes:.2f} | {res.relay_egress_max / 1e9:.0f} |")  # fmt: skip


def report(r: Run, p: Params, relays: list[bool], what_if: bool) -> None:
    c, first = r.costs, r.planned(relays[0])
    plan_s = [pl.plan_seconds for pl in first.plans]
    print(f"\n## {r.setup.note}")
    ideal = sum(pl.ideal_bytes for pl in first.plans) / 1e12
    print(f"publication: {first.model_bytes / 1e12:.3f} TB bf16 published, one engine reads "
          f"{sum(float(pl.bucket_bytes.sum()) for pl in first.plans) / 1e12:.3f} TB (its slices: {ideal:.3f} TB; "
          f"strict verify reads whole digest tiles); {first.specs:,} shard specs (their manifests "
          f"{c.was_bytes / 1e6:.0f} MB on the wire in format 4 alone, {first.digest_bytes / 1e6:.0f} MB of it base64 "
          f"block digests); per "
          f"version a receiver fetches {c.wire_bytes(first.part_digests) / 1e6:.2f} MB (its plan's part: "
          f"{first.part_digests:,} digests, raw; the shards it reads hold {first.digest_share:.1%} of them); "
          f"measured here: the registry's work {c.registry_s:.3f} s per version, one receiver's decode "
          f"{c.fetch_s(first.part_digests) * 1e3:.1f} ms; plans {min(plan_s):.2f}-{max(plan_s):.2f} s a rank "
          f"(first refit only)")  # fmt: skip
    for relay in relays:
        pl = r.planned(relay).plans
        print(f"  {'relaying' if relay else 'not relaying'}: per rank {max(x.bucket_bytes.size for x in pl):,} buckets,"
              f" {max(int(x.bucket_reads.sum()) for x in pl):,} reads")  # fmt: skip
    print("\n| case | relays | go → all committed, s | where the last receiver's time went, s | trainer egress, "
          "copies | max relay egress, GB |\n|---|---|---:|---|---:|---:|")  # fmt: skip
    results = [(relay, r.sim(p, relay)) for relay in relays]
    for relay, res in results:
        print(_row("as built (plan cached)", res, relay))
    for relay in relays:
        print(_row("first refit (plans built)", r.sim(p, relay, {"plan_s": max(plan_s)}), relay))
    for relay in relays if what_if else []:
        for name, changes in ladder(relay):
            print(_row(f"+ {name}", r.sim(p, relay, changes), relay))
    for relay, res in results:
        parts = ", ".join(f"{k} {v:.2f}" for k, v in res.bounds.items())
        print(f"\nlower bounds, {'relay' if relay else 'no relay'}, as built (s): {parts}; version complete at "
              f"{res.complete_at:.2f}")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenario", default="kimi,dsv3", help="comma list of kimi, dsv3, calib, flat")
    ap.add_argument("--relay", choices=["on", "off", "both"], default="both")
    ap.add_argument("--no-relay", action="store_true", help="everyone reads the trainer (= --relay off)")
    numeric = [f.name for f in dataclasses.fields(Params) if f.type in ("float", "float | None")]
    for name in [*numeric, "gpus_per_host"]:
        ap.add_argument("--" + name.replace("_", "-"), type=float if name in numeric else int, default=None)
    ap.add_argument("--announce-early", action="store_true", help="no relays: read before the digests are in")
    ap.add_argument("--fit", action="store_true", help="calib: fit bucket_us and fixed_ms again")
    ap.add_argument("--segments", type=int, default=128)
    ap.add_argument("--relay-bucket-mb", type=float, default=4.0, help="relays' relay_bucket_bytes (re-plans)")
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--tensors", type=int, default=64)
    ap.add_argument("--numel", type=int, default=250_000)
    ap.add_argument("--receivers", type=int, default=1)
    ap.add_argument("--what-if", action="store_true", help="add rows for changes refitflow does not have")
    ap.add_argument("--svg", type=pathlib.Path, help="plot time against GPU NIC bandwidth (kimi and dsv3)")
    ap.add_argument("--cache", type=pathlib.Path, default=pathlib.Path("/tmp/refitflow-sim"))
    a = ap.parse_args(argv)
    over = {k: getattr(a, k) for k in [*numeric, "gpus_per_host"] if getattr(a, k) is not None}
    p = Params(**over, segments=a.segments, announce_early=a.announce_early)
    relays = {"on": [True], "off": [False], "both": [True, False]}["off" if a.no_relay else a.relay]
    print(f"load average {os.getloadavg()[0]:.2f}; {os.cpu_count()} cores; parameters: {p}")
    bucket = int(a.relay_bucket_mb * MiB)
    runs = {}
    for name in a.scenario.split(","):
        if name == "calib":
            calibration(lambda k: setups.flat(64, 250_000, k, "calib"), a.cache, a.fit)
            continue
        setup = {"kimi": lambda: setups.kimi(a.layers, engines=a.engines),
                 "dsv3": lambda: setups.dsv3(a.layers, engines=a.engines),
                 "flat": lambda: setups.flat(a.tensors, a.numel, a.receivers)}[name]()  # fmt: skip
        runs[name] = Run(setup, measure(setup.pub), bucket, a.cache)
        report(runs[name], p, relays, a.what_if)
    if a.svg is not None:
        plot(runs, dataclasses.replace(p, segments=min(p.segments, 48)), a.svg, ladder(False)[-1][1])
        print(f"\nwrote {a.svg}")


if __name__ == "__main__":
    main()
