"""Refits at scale, simulated: refitflow's own planner, relay scheduler and registry decide who reads what
from whom and when; a fluid link model with max-min fair sharing decides how long it takes.

    python bench/simulate.py [--scenario kimi,kimi-bf16,dsv3,glm,calib] [--relay on|off|both]
        [--gpu-gbps 50] [--window 8] [--bucket-us 41] [--relay-bucket-us 35] [--read-us 2.8]
        [--device-verify-gbps 100] [--latency-us 10] [--registry-s S] [--fetch-s S] ... (every Params field)
        [--host-digests] [--pushed-relays] [--drivers] [--svg docs/scale.svg] [--cache DIR] [--calib-runs 1]

Every parameter is a field of ``_sim_model.Params`` (its comments say what each is); docs/scale.md says what
the model leaves out and how it is calibrated. The defaults are the data path issue 51 builds — a window of
buckets in flight, digests on the device, a relay's status polled by a reader close behind it (as the code does;
``--pushed-relays``: what if it were pushed) — with the per-bucket costs measured here
(``calib`` measures them; run with ``--scenario calib,kimi`` its figures are the ones the later scenarios use).

Scenarios (``_sim_setups``): ``kimi`` — Kimi-K2 published FP8, Megatron TP8 × EP32 × PP8 (256 GPUs) → 8 vLLM
engines of EP16 (128 GPUs); ``kimi-bf16`` the same in bf16; ``dsv3`` — DeepSeek-V3 FP8, Megatron PP16 × EP16
(256 GPUs) → 8 vLLM engines of TP32 (256 GPUs); ``glm`` — GLM-5 (744 B) FP8, Megatron PP8 × EP8 (64 GPUs) → one
vLLM engine of EP32 (32 GPUs); ``-bf16`` of any; ``calib`` — ``bench/fanout_bench.py`` and
``bench/bucket_cost.py`` run here, now, against the model; ``flat`` — ``--tensors`` float32 tensors, one
trainer rank, ``--receivers`` receivers (tests). Each prints time to all committed — with the device digest
rate's conservative and optimistic figures —, where the last engine's slowest rank spent it, each resource's
lower bound, the trainer's egress in model copies and the largest relay egress, beside the published anchors;
and the same refit with the data path before issue 51 (``_sim_model.TODAY``). ``--drivers``: what each cost
adds (the as-built time with it removed). ``--svg`` plots time against GPU NIC bandwidth.

Plans are the real ones, one per rank of one engine (engines are replicas), cached under ``--cache``
(reductions only, keyed by the planner's source). The control plane is as built too (issue 50): the registry's
work on a version's records and each receiver's fetch and decode of the ``latest`` answer and its plan's part
of the digests (``RankPlan.part_digests``: the digests its checks read) are measured here with the code on this
branch (``_sim_costs``) unless given (``--registry-s``, ``--fetch-s``); ``--drivers`` shows what it adds.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import _sim_setups as setups
from _sim_calib import calibration
from _sim_costs import Costs, measure
from _sim_model import DEVICE_GBPS, TODAY, Params, Result, simulate
from _sim_svg import plot
from _sim_traffic import Classes, Setup, plan_classes

__all__ = ["ANCHORS", "DRIVERS", "Run", "main"]

MiB = 1 << 20
# what each cost adds: the as-built refit with it removed, one at a time (``--drivers``)
DRIVERS: list[tuple[str, dict[str, object]]] = [
    ("refitflow's cost per bucket (bucket_us 0)", {"bucket_us": 0.0}),
    ("a relayed bucket's extra cost (relay_bucket_us 0)", {"relay_bucket_us": 0.0}),
    ("descriptors (read_us 0)", {"read_us": 0.0}),
    ("device digests (unlimited rate)", {"device_verify_gbps": 1e6}),
    ("control plane: the registry's work on the records, each receiver's part fetched and decoded (0)",
     {"registry_s": 0.0, "fetch_s": 0.0, "wire": 0}),
    ("the network round trip (latency_us 0)", {"latency_us": 0.0}),
]  # fmt: skip
_KIMI = "Perplexity (Kimi-K2 256 → 128 GPUs, RDMA WRITE, static schedule, FP8) 1.3 s; vLLM NIXL pull 7.53 s; "
ANCHORS = {  # published refit times (setup name → text), and issue 51's targets
    "kimi-fp8": _KIMI + "target ≤ 1.5 s",
    "kimi": _KIMI + "target in bf16 ≤ 3 s",
    "dsv3-fp8": "NeMo-RL DeepSeek-V3 reshard 1.93–2.83 s; target ≤ 1.5 s",
    "dsv3": "NeMo-RL DeepSeek-V3 reshard 1.93–2.83 s",
    "glm-fp8": "PRIME-RL NIXL pull, GLM-5.2 (44 GB/s per inference GPU): 2.84 s",
    "glm": "PRIME-RL NIXL pull, GLM-5.2 (44 GB/s per inference GPU): 2.84 s",
}  # fmt: skip


@dataclasses.dataclass
class Run:
    """One scenario's inputs: the setup, its planned classes (by relaying and relay bucket), measured costs."""

    setup: Setup
    costs: Costs
    bucket: int
    cache: pathlib.Path | None
    classes: dict[tuple[bool, int], Classes] = dataclasses.field(default_factory=dict)

    def planned(self, relay: bool) -> Classes:
        key = (relay, self.bucket if relay else 0)
        if key not in self.classes:
            self.classes[key] = plan_classes(self.setup, relay, self.bucket, self.cache)
        return self.classes[key]

    def sim(self, p: Params, relay: bool, changes: dict[str, object] | None = None) -> Result:
        """``p`` with ``changes`` (Params fields, and ``wire``: the bytes a receiver fetches per version) for this
        run. The control plane as built: the registry's work on a version's records (measured), each receiver's
        fetch of the ``latest`` answer and its plan's part of the digests, and its decode (measured per digest)."""
        ch = dict(changes or {})
        q = dataclasses.replace(p, **{k: v for k, v in ch.items() if k != "wire"})  # type: ignore[arg-type]
        cls = self.planned(relay)
        wire = ch.get("wire", self.costs.wire_bytes(cls.part_digests))
        reg = self.costs.registry_s if q.registry_s is None else q.registry_s
        pending = self.costs.pending_s if q.registry_s is None else q.registry_s
        fetch = self.costs.fetch_s(cls.part_digests) if q.fetch_s is None else q.fetch_s
        return simulate(cls, q, registry_s=reg, fetch_s=fetch, wire_bytes=int(wire),  # type: ignore[call-overload]
                        engines=self.setup.engines, relay=relay, pending_s=pending)  # fmt: skip


def _where(res: Result) -> str:
    top = sorted(res.phases.items(), key=lambda kv: -kv[1])[:3]
    return "; ".join(f"{k} {v:.2f}" for k, v in top)


def report(r: Run, p: Params, relays: list[bool], drivers: bool) -> None:
    c, first = r.costs, r.planned(relays[0])
    plan_s = [pl.plan_seconds for pl in first.plans]
    print(f"\n## {r.setup.note}")
    ideal = sum(pl.ideal_bytes for pl in first.plans) / 1e12
    print(f"publication: {first.model_bytes / 1e12:.3f} TB published, one engine reads "
          f"{sum(float(pl.bucket_bytes.sum()) for pl in first.plans) / 1e12:.3f} TB (its slices: {ideal:.3f} TB; "
          f"strict verify reads whole digest tiles, a converted parameter whole blocks); {first.specs:,} shard specs "
          f"(their manifests {c.was_bytes / 1e6:.0f} MB on the wire in format 4 alone, {first.digest_bytes / 1e6:.0f} "
          f"MB of it base64 block digests); per version a receiver fetches {c.wire_bytes(first.part_digests) / 1e6:.2f}"
          f" MB (its plan's part: {first.part_digests:,} digests, raw; the shards it reads hold "
          f"{first.digest_share:.1%} of them); measured here: the registry's work {c.registry_s:.3f} s per version "
          f"({c.pending_s:.3f} s of it before the digests, announced early), "
          f"one receiver's decode {c.fetch_s(first.part_digests) * 1e3:.1f} ms; plans "
          f"{min(plan_s):.2f}-{max(plan_s):.2f} s a rank (first refit only)")  # fmt: skip
    for relay in relays:
        pl = r.planned(relay).plans
        conv = max(x.converted for x in pl)
        print(f"  {'relaying' if relay else 'not relaying'}: per rank {max(x.bucket_bytes.size for x in pl):,} buckets,"
              f" {max(int(x.bucket_reads.sum()) for x in pl):,} reads (descriptors), "
              f"{max(float(x.bucket_bytes.sum()) for x in pl) / 1e9:.1f} GB; parameters converted (not copied): "
              f"{conv}")  # fmt: skip
    lo, hi = DEVICE_GBPS["conservative"], DEVICE_GBPS["optimistic"]
    print(f"\n| case | relays | go → all committed, s (device digests {lo:.0f} GB/s) | ({hi:.0f} GB/s) | data path: "
          "found → prepared, s | where the last receiver's time went, s | trainer egress, copies | max relay "
          "egress, GB |\n|---|---|---:|---:|---:|---|---:|---:|")  # fmt: skip
    rows = [("as built (plan cached)", {}), ("first refit (plans built)", {"plan_s": max(plan_s)}),
            ("before issue 51 (window 1, host digests, polled relays)", TODAY)]  # fmt: skip
    built = {}
    for name, ch in rows:
        for relay in relays:
            res = r.sim(p, relay, ch)
            fast = r.sim(p, relay, ch | {"device_verify_gbps": hi}).committed if p.device_digests else res.committed
            fast_s = f"{fast:.2f}" if "device_digests" not in ch else "–"
            built.setdefault(relay, res)
            copies = res.trainer_egress / res.engine_bytes
            print(f"| {name} | {'relay' if relay else 'no relay'} | **{res.committed:.2f}** | {fast_s} | "
                  f"{res.slowest_found_to_prepared:.2f} | {_where(res)} | {copies:.2f} | "
                  f"{res.relay_egress_max / 1e9:.0f} |")  # fmt: skip
    for relay, res in built.items():
        parts = ", ".join(f"{k} {v:.2f}" for k, v in res.bounds.items())
        print(f"\nlower bounds, {'relay' if relay else 'no relay'}, as built (s): {parts}; version complete at "
              f"{res.complete_at:.2f}")  # fmt: skip
    print(f"\nanchors: {ANCHORS.get(r.setup.name, '–')}")
    if drivers:
        print("\n| as built, without | relays | go → all committed, s | saves, s |\n|---|---|---:|---:|")
        for relay, res in built.items():
            for name, ch in DRIVERS:
                t = r.sim(p, relay, ch).committed
                print(f"| {name} | {'relay' if relay else 'no relay'} | {t:.2f} | {res.committed - t:.2f} |")


def _setup(name: str, a: argparse.Namespace) -> Setup:
    base, _, dtype = name.partition("-")
    fp8 = dtype != "bf16"
    if base == "kimi":
        return setups.kimi(a.layers or 61, engines=a.engines or 8, fp8=fp8)
    if base == "dsv3":
        return setups.dsv3(a.layers or 61, engines=a.engines or 8, fp8=fp8)
    if base == "glm":
        return setups.glm(a.layers or 78, engines=a.engines or 1, fp8=fp8)
    if base == "flat":
        return setups.flat(a.tensors, a.numel, a.receivers)
    raise SystemExit(f"unknown scenario {name!r}: kimi, dsv3, glm (each -bf16 too), calib, flat")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenario", default="kimi,kimi-bf16,dsv3,glm", help="comma list (see above)")
    ap.add_argument("--relay", choices=["on", "off", "both"], default="both")
    numeric = [f.name for f in dataclasses.fields(Params) if f.type in ("float", "float | None")]
    ints = ["gpus_per_host", "window", "segments"]
    for name in [*numeric, *ints]:
        ap.add_argument("--" + name.replace("_", "-"), type=float if name in numeric else int, default=None)
    ap.add_argument("--host-digests", action="store_true", help="digests hashed on the host (before issue 51)")
    ap.add_argument("--pushed-relays", action="store_true", help="what if relay progress were pushed (not built)")
    ap.add_argument("--no-announce-early", action="store_true", help="readers wait for the digests")
    ap.add_argument("--drivers", action="store_true", help="what each cost adds to the as-built time")
    ap.add_argument("--calib-runs", type=int, default=3, help="calib: runs of each fanout_bench command")
    ap.add_argument("--relay-bucket-mb", type=float, default=4.0, help="relays' relay_bucket_bytes (re-plans)")
    ap.add_argument("--engines", type=int, default=0)
    ap.add_argument("--layers", type=int, default=0)
    ap.add_argument("--tensors", type=int, default=64)
    ap.add_argument("--numel", type=int, default=250_000)
    ap.add_argument("--receivers", type=int, default=1)
    ap.add_argument("--svg", type=pathlib.Path, help="plot time against GPU NIC bandwidth (kimi and dsv3)")
    ap.add_argument("--cache", type=pathlib.Path, default=pathlib.Path("/tmp/refitflow-sim"))
    a = ap.parse_args(argv)
    over = {k: getattr(a, k) for k in [*numeric, *ints] if getattr(a, k) is not None}
    flags = {"device_digests": not a.host_digests, "relay_push": a.pushed_relays,
             "announce_early": not a.no_announce_early}  # fmt: skip
    p = Params(**over, **flags)
    print(f"load average {os.getloadavg()[0]:.2f}; {os.cpu_count()} cores; parameters: {p}")
    bucket, runs, t0 = int(a.relay_bucket_mb * MiB), {}, time.perf_counter()
    for name in a.scenario.split(","):
        if name == "calib":
            got = calibration(lambda k: setups.flat(64, 250_000, k, "calib"), a.cache, a.calib_runs)
            mine = {k: v for k, v in got.items() if k not in over}
            p = dataclasses.replace(p, **mine)
            print(f"\nthe scenarios below use the calibration's {mine}")
            continue
        setup = _setup(name, a)
        runs[name] = Run(setup, measure(setup.pub), bucket, a.cache)
        relays = {"on": [True], "off": [False], "both": [True, False]}[a.relay] if setup.engines > 1 else [False]
        report(runs[name], p, relays, a.drivers)
    if a.svg is not None:
        plot(runs, dataclasses.replace(p, segments=min(p.segments, 48)), a.svg, TODAY)
        print(f"\nwrote {a.svg}")
    print(f"\n{time.perf_counter() - t0:.0f} s in all")


if __name__ == "__main__":
    main()
