"""The ``calib`` scenario of ``bench/simulate.py``: the model against runs made here, now, in the same command.

1. **Measured**: ``bench/bucket_cost.py`` (a publisher process, NIXL, the same bytes refit in 4 … 1,024 buckets,
   interleaved with raw READs of the same ranges): the seconds a bucket costs a refit and a raw read (slopes),
   and the raw copy rate (the fit's intercept); ``bench/relay_cost.py --rounds 3``: a relayed bucket's own cost
   (the slope over bucket count read from a verified relay less the slope from the trainer); xxh3's rate on one
   core (in this process); then
   ``bench/fanout_bench.py --together 1,1,4,4,8,8 --frozen 0``, relaying and ``--no-relay`` alternating
   (``runs`` times each): the slowest receiver's seconds (``RefitResult.seconds``: found → prepared) and the
   trainer's egress in model copies, per row; the best of the runs is compared (the least disturbed by the other
   work of a shared machine, as bucket_cost.py's best rounds are), and the cores that other work used meanwhile
   are printed (the machine's busy time less this run's). The first row of each pair has receivers at their first refit
   after the warm-up (four of them at k = 8); the second has every receiver warm.
2. **The model of this machine**: one host, its cores a resource (``host_cores``); a read is a CPU copy by the
   reader at the measured raw rate (CMA), no source-side limit; verify is xxh3 on a core at the measured rate;
   the receivers' window of buckets in flight (``WINDOW``: the code's default), relay progress polled while a
   reader waits (``refit.fanout.reading.poll_sleeps``: paced by its waits); a bucket's serial cost the measured
   refit slope (``bucket_us``: refitflow's own cost and the raw read's, both CPU here). ``bucket_cost.py``'s own
   cost is the refit slope less the slope of the same raw READs submitted with the refit's window in flight
   (against READs posted one at a time it came out negative).
3. **Fitted**, on the first rows of each pair: ``host_cores`` (the cores the refits had, as they used them: the
   machine is shared, and 8 receivers' copies, hashing and polling threads contend for 2 cores and one memory
   bus), ``fixed_ms`` (any other cost per refit) and ``first_use_ms`` (a receiver's first refit after the
   warm-up: it writes its other shadow storage for the first time) from the no-relay rows, then
   a relaying receiver's ``first_use_ms`` from the relay rows; grid searches for the smallest worst relative error.
   ``relay_bucket_us`` (a relayed bucket's extra cost: the relay's status reads, its bookkeeping) is not fitted:
   ``bench/relay_cost.py`` measures it directly in the same run (16 relayed buckets of the fanout rows, 10 ms of a
   0.13 s refit, left it weakly determined: fitted, it came out at 650 us against the 23 us measured).
   **Checked**: every row, the warm ones held out — within 20 %.

What the scenarios then use: ``bucket_us`` = refitflow's own cost (the refit slope less the windowed raw read's: on a
cluster the transport's round trip is ``latency_us``, overlapped by the window) and ``relay_bucket_us``.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import pathlib
import re
import resource
import subprocess
import sys
import time
from collections.abc import Callable

import numpy as np
import xxhash
from _sim_model import WINDOW, Params, simulate
from _sim_traffic import Classes, Setup, plan_classes

__all__ = ["calibration", "fit_and_check", "machine", "measure_here"]

BENCH = pathlib.Path(__file__).resolve().parent
TOGETHER = (1, 1, 4, 4, 8, 8)
Rows = dict[bool, list[tuple[int, list[float], float]]]  # relay → per row (k, slowest s per run, egress copies)
_PLANNED: dict[tuple[int, bool], Classes] = {}
_ROW = re.compile(r"^\s*(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s*$")


def _run(args: list[str], timeout: float = 600) -> str:
    """A bench script in a child process (this environment: PYTHONPATH as given), its stdout."""
    done = subprocess.run([sys.executable, *args], cwd=BENCH.parent, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return done.stdout


def _busy() -> tuple[float, float, float]:
    """(the machine's busy CPU seconds, this process's children's CPU seconds, now)."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK"), ru.ru_utime + ru.ru_stime, time.time()


def others(before: tuple[float, float, float]) -> float:
    """Cores the machine's other work used on average since ``before`` (busy CPU less this run's children's)."""
    after = _busy()
    return max(0.0, (after[0] - before[0]) - (after[1] - before[1])) / max(after[2] - before[2], 1e-9)


def fanout(relay: bool) -> list[tuple[int, float, float]]:
    """One ``fanout_bench.py`` run: per row (k, the slowest receiver's seconds, egress copies)."""
    args = [str(BENCH / "fanout_bench.py"), "--together", ",".join(map(str, TOGETHER)), "--frozen", "0"]
    out = _run(args + ([] if relay else ["--no-relay"]))
    rows = [(int(m[1]), float(m[5]), float(m[2])) for line in out.splitlines() if (m := _ROW.match(line))]
    if [k for k, _, _ in rows] != list(TOGETHER):
        raise RuntimeError(f"unexpected fanout_bench output:\n{out}")
    return rows


def bucket_cost() -> dict[str, float]:
    """``bucket_cost.py``: seconds a bucket costs a refit and a raw read, and the raw copy rate (GB/s)."""
    out = _run([str(BENCH / "bucket_cost.py")])
    size = float(re.search(r"tensors, ([\d.]+) MB", out)[1]) * 1e6  # type: ignore[index]
    table = [line.strip("|").split("|") for line in out.splitlines() if re.match(r"^\| \d", line)]
    reads = np.array([float(r[1]) for r in table])
    raw = np.array([float(r[3]) for r in table])
    _, intercept = np.polyfit(reads, raw, 1)
    m = re.search(r"per bucket: refit (-?\d+) us; raw reads one at a time (-?\d+) us, windowed (-?\d+) us; "
                  r"refitflow's own (-?\d+) us", out)  # fmt: skip
    assert m is not None, out
    return {"refit_us": float(m[1]), "raw_us": float(m[2]), "win_us": float(m[3]), "own_us": float(m[4]),
            "copy_gbps": size / max(intercept, raw.min() / 2) / 1e9}  # fmt: skip


def relay_cost() -> float:
    """``relay_cost.py``: a relayed bucket's own cost (us): the slope of refit time over bucket count, read from a
    verified relay, less the slope of the same reader reading the trainer."""
    out = _run([str(BENCH / "relay_cost.py"), "--rounds", "3"])
    m = re.search(r"a relayed bucket's own (-?\d+) us", out)
    assert m is not None, out
    return float(m[1])


def xxh3_gbps(nbytes: int = 64 << 20, repeat: int = 5) -> float:
    buf = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8).tobytes()
    best = min(_timed(lambda: xxhash.xxh3_64_intdigest(buf)) for _ in range(repeat))
    return nbytes / best / 1e9


def _timed(f: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    f()
    return time.perf_counter() - t0


def machine(copy_gbps: float, verify_gbps: float, bucket_us: float) -> Params:
    """This machine as the model sees it: the code's window of buckets in flight, relays polled while waited for."""
    return Params(
        gpu_gbps=copy_gbps, egress_limit=False, latency_us=0.0, gpus_per_host=64, window=WINDOW, device_digests=False,
        verify_gbps=verify_gbps, host_cores=float(os.cpu_count() or 2), cpu_copies=True, cpu_verify=True,
        bucket_us=bucket_us, read_us=0.0, relay_push=False, poll_floor_ms=1.0, registry_rtt_ms=0.0, registry_s=0.0,
        fetch_s=0.0, commit_ms=0.0, announce_early=False, rotate=False, segments=1 << 20,
    )  # fmt: skip


def predict(make: Callable[[int], Setup], p: Params, cache: pathlib.Path | None, relay: bool,
            rows: list[int], first_use_ms: float = 0.0) -> list[tuple[float, float]]:  # fmt: skip
    """Per row of ``TOGETHER`` asked for: (the slowest receiver's found → prepared, egress copies)."""
    out = []
    for i in rows:
        k = TOGETHER[i]
        fresh = range(max(TOGETHER[:i], default=0), k) if i % 2 == 0 else range(0)
        q = dataclasses.replace(p, first_use_ms=dict.fromkeys(fresh, first_use_ms))
        if (k, relay) not in _PLANNED:
            _PLANNED[(k, relay)] = plan_classes(make(k), relay, cache=cache, log=lambda s: None)
        cls = _PLANNED[(k, relay)]
        res = simulate(cls, q, registry_s=0.0, fetch_s=0.0, wire_bytes=0, engines=k, relay=relay)
        out.append((res.slowest_found_to_prepared, res.trainer_egress / res.engine_bytes))
    return out


def _worst(pred: list[tuple[float, float]], measured: list[float]) -> float:
    return max(abs(s / m - 1) for (s, _), m in zip(pred, measured, strict=True))


def measure_here(runs: int = 2) -> dict:
    """Every measurement the calibration uses, made now (JSON-able)."""
    t0, load = time.perf_counter(), os.getloadavg()[0]
    cost = bucket_cost()
    cost["relay_us"] = relay_cost()
    xxh = xxh3_gbps()
    raw: dict[bool, list[list[tuple[int, float, float]]]] = {True: [], False: []}
    busy = _busy()
    for _ in range(runs):  # relaying and not, alternating
        for relay in (True, False):
            raw[relay].append(fanout(relay))
    rows = {str(r): [(k, [g[i][1] for g in got], got[0][i][2]) for i, k in enumerate(TOGETHER)]
            for r, got in raw.items()}  # fmt: skip
    return {"cost": cost, "xxh3_gbps": xxh, "others": others(busy), "rows": rows, "runs": runs, "load": load,
            "load_after": os.getloadavg()[0], "seconds": time.perf_counter() - t0, "when": time.ctime()}  # fmt: skip


def calibration(make: Callable[[int], Setup], cache: pathlib.Path | None, runs: int = 2) -> dict[str, float]:
    """Measure (kept as JSON in ``cache``), fit, compare (printed); returns the figures the scenarios use
    (``bucket_us``, ``relay_bucket_us``)."""
    print(f"\n## calib: measured here, now (load average {os.getloadavg()[0]:.2f}, {os.cpu_count()} cores, shared)")
    m = measure_here(runs)
    if cache is not None:
        cache.mkdir(parents=True, exist_ok=True)
        (cache / f"calib-{time.strftime('%Y%m%d-%H%M%S')}.json").write_text(json.dumps(m))
    return fit_and_check(make, cache, m)


def fit_and_check(make: Callable[[int], Setup], cache: pathlib.Path | None, m: dict) -> dict[str, float]:
    """Fit the model to ``measure_here``'s figures and compare every row (printed)."""
    t0, cost, xxh, used = time.perf_counter(), m["cost"], m["xxh3_gbps"], m["others"]
    measured: Rows = {r == "True": rows for r, rows in m["rows"].items()}
    best = {r: [min(x[1]) for x in rows] for r, rows in measured.items()}  # the least disturbed of the runs
    print(f"bench/bucket_cost.py: a bucket costs a refit {cost['refit_us']:.0f} us, a raw READ "
          f"{cost['raw_us']:.0f} us (windowed {cost.get('win_us', float('nan')):.0f} us), refitflow's own "
          f"{cost['own_us']:.0f} us; raw copy {cost['copy_gbps']:.2f} GB/s; "
          f"xxh3 {xxh:.1f} GB/s a core; bench/fanout_bench.py x {m['runs']} each, alternating: other work used "
          f"{used:.2f} of the {os.cpu_count()} cores meanwhile; measured in {m['seconds']:.0f} s ({m['when']}, load "
          f"average {m['load']:.2f} before, {m['load_after']:.2f} after)")  # fmt: skip
    p = machine(cost["copy_gbps"], xxh, cost["refit_us"])
    first, warm = [i for i in range(len(TOGETHER)) if i % 2 == 0], [i for i in range(len(TOGETHER)) if i % 2]
    pick = lambda r, idx: [best[r][i] for i in idx]  # noqa: E731

    def err_pull(f: float, cores: float, ms: float) -> float:
        q = dataclasses.replace(p, fixed_ms=f, host_cores=cores)
        return _worst(predict(make, q, cache, False, first, ms), pick(False, first))

    grid = itertools.product(range(0, 21, 2), [c / 10 for c in range(2, 21)], range(0, 41, 5))
    fixed, cores, pull_ms = min(grid, key=lambda g: err_pull(*g))
    p = dataclasses.replace(p, fixed_ms=float(fixed), host_cores=cores)

    def err(us: float, ms: float) -> float:
        pred = predict(make, dataclasses.replace(p, relay_bucket_us=us), cache, True, first, ms)
        return _worst(pred, pick(True, first))

    if "relay_us" in cost:  # measured (relay_cost.py): only a relaying receiver's first use is fitted
        relay_us, how = max(cost["relay_us"], 0.0), "measured by bench/relay_cost.py"
        first_ms = min(range(0, 61, 5), key=lambda ms: err(relay_us, ms))
    else:  # figures measured before relay_cost.py was part of the calibration: fitted with the rest
        coarse = min(itertools.product(range(0, 8001, 250), range(0, 61, 5)), key=lambda g: err(*g))
        fine = itertools.product(range(max(0, coarse[0] - 250), coarse[0] + 251, 50), [coarse[1]])
        (relay_us, first_ms), how = min(fine, key=lambda g: err(*g)), "fitted"
    p = dataclasses.replace(p, relay_bucket_us=float(relay_us))
    print(
        f"fitted on the first rows: host_cores {cores:.1f} (the cores the refits had: other work used {used:.2f}), "
        f"fixed_ms {fixed:.0f}, first_use_ms {pull_ms} (not relaying) / {first_ms} (relaying); relay_bucket_us "
        f"{relay_us:.0f} ({how})"
    )
    worst = 0.0
    for name, idx in (("first rows (fitted)", first), ("second rows (warm, held out)", warm)):
        print(f"\n{name}\n\n| relays | together | measured slowest s (best of the runs) | runs | predicted s | error "
              "| egress copies measured / predicted |\n|---|---:|---:|---|---:|---:|---|")  # fmt: skip
        for relay in (True, False):
            pred = predict(make, p, cache, relay, idx, first_ms if relay else pull_ms)
            for i, (s, e) in zip(idx, pred, strict=True):
                k, runs_s, egress = measured[relay][i]
                got = best[relay][i]
                worst = max(worst, abs(s / got - 1))
                each = ", ".join(f"{x:.3f}" for x in runs_s)
                print(f"| {'relay' if relay else 'no relay'} | {k} | {got:.3f} | {each} | {s:.3f} | {s / got - 1:+.0%} "
                      f"| {egress:.2f} / {e:.2f} |")  # fmt: skip
    verdict = "within" if worst <= 0.20 else "NOT within"
    print(
        f"\nworst error {worst:.0%}: {verdict} 20 %; measured in {m['seconds']:.0f} s, fitted and compared in "
        f"{time.perf_counter() - t0:.0f} s"
    )
    return {"bucket_us": max(cost["own_us"], 0.0), "relay_bucket_us": float(relay_us)}
