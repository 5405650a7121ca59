"""The ``calib`` scenario of ``bench/simulate.py``: the model against runs made here, now, in the same command.

1. **Measured**: ``bench/bucket_cost.py`` (a publisher process, NIXL, the same bytes refit in 4 … 1,024 buckets,
   interleaved with raw READs of the same ranges): the seconds a bucket costs a refit and a raw read (slopes),
   and the raw copy rate (the fit's intercept); ``bench/relay_cost.py --rounds 3``: a relayed bucket's own cost
   (the slope over bucket count read from a verified relay less the slope from the trainer) and a status read's
   CPU (``status_us``); xxh3's rate on one core (in this process); then
   ``bench/fanout_bench.py --together 1,1,4,4,8,8 --frozen 0``, relaying and ``--no-relay`` alternating
   (``runs`` times each): the slowest receiver's seconds (``RefitResult.seconds``: found → prepared), the
   trainer's egress in model copies and the receivers' CPU, per row; the best of the runs is compared (the least
   disturbed by the other work of a shared machine, as bucket_cost.py's best rounds are), and the cores that
   other work used meanwhile are printed (the machine's busy time less this run's). Every receiver is warm in
   every row (``fanout_bench.py`` warms both storages of each up first): the two rows of a pair are replicates.
2. **The model of this machine**: one host, its cores a resource (``host_cores``); a read is a CPU copy by the
   reader at the measured raw rate (CMA), no source-side limit; verify is xxh3 on a core at the measured rate;
   the receivers' window of buckets in flight (``WINDOW``: the code's default), relay progress polled while a
   reader waits (``refit.fanout.reading.poll_sleeps``: paced by its waits); a bucket's serial cost the measured
   refit slope (``bucket_us``: refitflow's own cost and the raw read's, both CPU here). ``bucket_cost.py``'s own
   cost is the refit slope less the slope of the same raw READs submitted with the refit's window in flight
   (against READs posted one at a time it came out negative).
3. **Fitted**, on the first row of each pair: ``host_cores`` (the cores the refits had, as they used them: the
   machine is shared, and 8 receivers' copies, hashing and polling threads contend for 2 cores and one memory
   bus) and ``cpu_ms`` (a receiver's CPU a version beyond its buckets and bytes: its threads' hand-offs, the
   registry's round trips — on a box this oversubscribed the refits are bound by CPU, so such a cost grows with
   the receivers where a fixed latency would not) from the no-relay rows, then ``relay_cpu_ms`` (a relaying
   receiver's CPU a version beyond a plain receiver's: its status words, its progress thread while read) and
   ``reader_cpu_ms`` (more for one that reads a relay: its relayed reads prepared anew for an upstream it did not
   read last version, its waits' wake-ups) from the relay rows (the lone relay reads no relay); grid searches
   for the smallest worst relative error. Beside the fit it prints what ``fanout_bench.py`` measured of the
   receivers' CPU (every thread of each, ``/proc``), relaying and not: what the two stand for.
   ``relay_bucket_us`` (a relayed bucket's own cost in a steady relay) and ``status_us`` are not fitted:
   ``bench/relay_cost.py`` measures them directly in the same run.
   **Checked**: every row, the second of each pair held out — within 20 %.

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
Rows = dict[bool, list[list]]  # relay → per row [k, slowest s per run, egress copies, CPU ms a receiver per run]
_PLANNED: dict[tuple[int, bool], Classes] = {}
_ROW = re.compile(r"^\s*(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s*$")


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


def fanout(relay: bool) -> list[tuple[int, float, float, float]]:
    """One ``fanout_bench.py`` run: per row (k, the slowest receiver's seconds, egress copies, CPU ms a receiver)."""
    args = [str(BENCH / "fanout_bench.py"), "--together", ",".join(map(str, TOGETHER)), "--frozen", "0"]
    out = _run(args + ([] if relay else ["--no-relay"]))
    rows = [(int(m[1]), float(m[5]), float(m[2]), float(m[7])) for line in out.splitlines() if (m := _ROW.match(line))]
    if [r[0] for r in rows] != list(TOGETHER):
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


def relay_cost() -> tuple[float, float]:
    """``relay_cost.py``: a relayed bucket's own cost (us: the slope of refit time over bucket count, read from a
    verified relay, less the slope of the same reader reading the trainer) and a status read's CPU (us)."""
    out = _run([str(BENCH / "relay_cost.py"), "--rounds", "3"])
    m = re.search(r"a relayed bucket's own (-?\d+) us.*a status read's CPU (\d+) us", out, re.S)
    assert m is not None, out
    return float(m[1]), float(m[2])


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
            rows: list[int]) -> list[tuple[float, float]]:  # fmt: skip
    """Per row of ``TOGETHER`` asked for: (the slowest receiver's found → prepared, egress copies)."""
    out = []
    for i in rows:
        k = TOGETHER[i]
        if (k, relay) not in _PLANNED:
            _PLANNED[(k, relay)] = plan_classes(make(k), relay, cache=cache, log=lambda s: None)
        res = simulate(_PLANNED[(k, relay)], p, registry_s=0.0, fetch_s=0.0, wire_bytes=0, engines=k, relay=relay)
        out.append((res.slowest_found_to_prepared, res.trainer_egress / res.engine_bytes))
    return out


def _worst(pred: list[tuple[float, float]], measured: list[float]) -> float:
    return max(abs(s / m - 1) for (s, _), m in zip(pred, measured, strict=True))


def measure_here(runs: int = 3) -> dict:
    """Every measurement the calibration uses, made now (JSON-able)."""
    t0, load = time.perf_counter(), os.getloadavg()[0]
    cost = bucket_cost()
    cost["relay_us"], cost["status_us"] = relay_cost()
    xxh = xxh3_gbps()
    raw: dict[bool, list[list[tuple[int, float, float, float]]]] = {True: [], False: []}
    busy = _busy()
    for _ in range(runs):  # relaying and not, alternating
        for relay in (True, False):
            raw[relay].append(fanout(relay))
    rows = {str(r): [(k, [g[i][1] for g in got], got[0][i][2], [g[i][3] for g in got]) for i, k in enumerate(TOGETHER)]
            for r, got in raw.items()}  # fmt: skip
    return {"cost": cost, "xxh3_gbps": xxh, "others": others(busy), "rows": rows, "runs": runs, "load": load,
            "load_after": os.getloadavg()[0], "seconds": time.perf_counter() - t0, "when": time.ctime()}  # fmt: skip


def calibration(make: Callable[[int], Setup], cache: pathlib.Path | None, runs: int = 3) -> dict[str, float]:
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
    p = dataclasses.replace(machine(cost["copy_gbps"], xxh, cost["refit_us"]), status_us=cost.get("status_us", 0.0))
    first, second = [i for i in range(len(TOGETHER)) if i % 2 == 0], [i for i in range(len(TOGETHER)) if i % 2]
    pick = lambda r, idx: [best[r][i] for i in idx]  # noqa: E731

    def err_pull(upkeep: float, cores: float) -> float:
        q = dataclasses.replace(p, cpu_ms=upkeep, host_cores=cores)
        return _worst(predict(make, q, cache, False, first), pick(False, first))

    upkeep_ms, cores = min(itertools.product(range(0, 31, 2), [c / 10 for c in range(2, 21)]),
                           key=lambda g: err_pull(*g))  # fmt: skip
    p = dataclasses.replace(p, cpu_ms=float(upkeep_ms), host_cores=cores)
    relay_us = max(cost["relay_us"], 0.0)  # measured (relay_cost.py), as is a status read's CPU

    def err(own: float, reader: float) -> float:
        q = dataclasses.replace(p, relay_bucket_us=relay_us, relay_cpu_ms=own, reader_cpu_ms=reader)
        return _worst(predict(make, q, cache, True, first), pick(True, first))

    own, reader = min(itertools.product(range(0, 41, 2), range(0, 61, 3)), key=lambda g: err(*g))
    p = dataclasses.replace(p, relay_bucket_us=float(relay_us), relay_cpu_ms=float(own), reader_cpu_ms=float(reader))
    print(
        f"fitted on the first row of each pair: host_cores {cores:.1f} (the cores the refits had: other work used "
        f"{used:.2f}), cpu_ms {upkeep_ms:.0f}, relay_cpu_ms {own:.0f}, reader_cpu_ms {reader:.0f}; measured by "
        f"bench/relay_cost.py: relay_bucket_us {relay_us:.0f}, status_us {p.status_us:.0f}"
    )
    if all(len(row) > 3 for rows in measured.values() for row in rows):  # CPU measured (fanout_bench.py's column)
        n = os.cpu_count() or 2
        cpu = {r: [min(row[3]) for row in rows] for r, rows in measured.items()}
        each = ", ".join(f"{TOGETHER[i]}: {cpu[True][i]:.0f} / {cpu[False][i]:.0f}" for i in first)
        print(f"what a relay's upkeep is on this machine's CPU: the model's CPU, whose cores were fitted at "
              f"{cores:.1f} of {n}, stands for {n / cores:.1f}x as much of it — relay_cpu_ms {own:.0f} is "
              f"{own * n / cores:.0f} ms, reader_cpu_ms {reader:.0f} is {reader * n / cores:.0f} ms; measured "
              f"(fanout_bench.py, CPU ms a receiver, relaying / not, first rows by receivers together): "
              f"{each}")  # fmt: skip
    worst = 0.0
    for name, idx in (("first rows (fitted)", first), ("second rows (held out)", second)):
        print(f"\n{name}\n\n| relays | together | measured slowest s (best of the runs) | runs | predicted s | error "
              "| egress copies measured / predicted |\n|---|---:|---:|---|---:|---:|---|")  # fmt: skip
        for relay in (True, False):
            pred = predict(make, p, cache, relay, idx)
            for i, (s, e) in zip(idx, pred, strict=True):
                k, runs_s, egress = measured[relay][i][:3]
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
