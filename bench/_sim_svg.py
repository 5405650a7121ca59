"""A small hand-built SVG for ``bench/simulate.py --svg``: time to all committed against GPU NIC bandwidth
(log-log), as built (with and without relays) and before issue 51, beside the published anchors."""

from __future__ import annotations

import dataclasses
import math
import pathlib
from typing import Any

__all__ = ["BANDWIDTHS", "plot"]

BANDWIDTHS = (12.5, 25.0, 50.0, 100.0, 200.0, 400.0)
ANCHORS = (  # (seconds, label, colour)
    (1.3, "Kimi-K2 256→128 GPUs, RDMA WRITE, static schedule, FP8: 1.3 s", "#d62728"),
    (1.93, "NeMo-RL DeepSeek-V3 reshard: 1.93–2.83 s", "#9467bd"),
    (2.83, "", "#9467bd"),
    (2.84, "PRIME-RL NIXL pull, GLM-5.2: 2.84 s", "#e377c2"),
    (7.53, "vLLM NIXL pull, Kimi-K2 on 48×8 H100: 7.53 s", "#8c564b"),
    (15.0, "checkpoint-engine: 14–16 s", "#7f7f7f"),
)
W, H, L, R, T, B = 760, 640, 60, 250, 20, 230
Y0, Y1 = 0.3, 300.0


def _x(gbps: float) -> float:
    lo, hi = math.log(BANDWIDTHS[0]), math.log(BANDWIDTHS[-1])
    return L + (math.log(gbps) - lo) / (hi - lo) * (W - L - R)


def _y(s: float) -> float:
    s = min(max(s, Y0), Y1)
    return T + (1 - (math.log(s) - math.log(Y0)) / (math.log(Y1) - math.log(Y0))) * (H - T - B)


def curves(runs: dict[str, Any], p: Any, today: dict[str, object]) -> list[tuple[str, str, list]]:
    """(label, colour, [(GB/s, seconds)]) per scenario: as built with and without relays (one engine: without),
    and before issue 51 without relays."""
    out = []
    palette = ("#1f77b4", "#2ca02c", "#ff7f0e", "#17becf", "#bcbd22", "#8c564b")
    for c, (name, run) in enumerate(runs.items()):
        colour = palette[c % len(palette)]
        modes = [True, False] if run.setup.engines > 1 else [False]
        for relay in modes:
            pts = [(g, run.sim(dataclasses.replace(p, gpu_gbps=g), relay).committed) for g in BANDWIDTHS]
            out.append((f"{name}: as built, {'relays' if relay else 'no relays'}", colour, pts))
        pts = [(g, run.sim(dataclasses.replace(p, gpu_gbps=g), False, today).committed) for g in BANDWIDTHS]
        out.append((f"{name}: before issue 51, no relays", colour + "80", pts))
    return out


def plot(runs: dict[str, Any], p: Any, path: pathlib.Path, today: dict[str, object]) -> None:
    lines = curves(runs, p, today)
    e = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="11">',
         f'<rect width="{W}" height="{H}" fill="white"/>']  # fmt: skip
    for s in (0.3, 1, 3, 10, 30, 100, 300):
        y = _y(s)
        e.append(f'<line x1="{L}" x2="{W - R}" y1="{y:.1f}" y2="{y:.1f}" stroke="#eee"/>')
        e.append(f'<text x="{L - 6}" y="{y + 4:.1f}" text-anchor="end">{s:g} s</text>')
    for g in BANDWIDTHS:
        x = _x(g)
        e.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{T}" y2="{H - B}" stroke="#eee"/>')
        e.append(f'<text x="{x:.1f}" y="{H - B + 16}" text-anchor="middle">{g:g}</text>')
    e.append(f'<text x="{(L + W - R) / 2:.0f}" y="{H - B + 34}" text-anchor="middle">GPU NIC bandwidth, GB/s '
             "(each direction)</text>")  # fmt: skip
    e.append(f'<text x="14" y="{(T + H - B) / 2:.0f}" transform="rotate(-90 14 {(T + H - B) / 2:.0f})" '
             'text-anchor="middle">time to all committed</text>')  # fmt: skip
    for s, label, colour in ANCHORS:
        y = _y(s)
        e.append(f'<line x1="{L}" x2="{W - R}" y1="{y:.1f}" y2="{y:.1f}" stroke="{colour}" stroke-dasharray="5,4"/>')
        if label:
            e.append(f'<text x="{W - R + 6}" y="{y + 4:.1f}" fill="{colour}" font-size="9">{label}</text>')
    for k, (label, colour, pts) in enumerate(lines):
        d = " ".join(f"{'M' if i == 0 else 'L'}{_x(g):.1f},{_y(s):.1f}" for i, (g, s) in enumerate(pts))
        e.append(f'<path d="{d}" fill="none" stroke="{colour}" stroke-width="2"/>')
        e += [f'<circle cx="{_x(g):.1f}" cy="{_y(s):.1f}" r="3" fill="{colour}"/>' for g, s in pts]
        y = H - B + 56 + 14 * k
        e.append(f'<line x1="{L + 10}" x2="{L + 30}" y1="{y - 4}" y2="{y - 4}" stroke="{colour}" stroke-width="2"/>')
        e.append(f'<text x="{L + 36}" y="{y}">{label}</text>')
    e.append("</svg>")
    path.write_text("\n".join(e) + "\n")
