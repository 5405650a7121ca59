"""What the demo shows: live progress per receiving rank, a line per refit (bytes pulled against the rank's
slice), the logits check per engine and version, and a per-stage table at the end."""

from __future__ import annotations

from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table

from refitflow.metrics import STAGES

__all__ = ["DemoView"]

WIDE = 200  # columns when the output is not a terminal (a log, a pipe): never cut the table


class DemoView:
    def __init__(
        self, versions: int, *, receivers: list[str], engines: list[str] | None = None, console: Console | None = None
    ) -> None:
        if console is None:
            console = Console()
            if not console.is_terminal:
                console = Console(width=WIDE)
        self.console = console
        self.versions, self.receivers, self.engines = versions, receivers, engines or []
        self.progress = Progress(
            TextColumn("{task.description:<16}"), BarColumn(), DownloadColumn(binary_units=False),
            TextColumn("{task.fields[gbps]:>6} GB/s  {task.fields[stage]:<9}"), TimeElapsedColumn(),
            console=self.console, transient=False,
        )  # fmt: skip
        self.tasks: dict[str, TaskID] = {}
        self.totals: dict[str, int] = {}
        self.refits: list[dict[str, Any]] = []
        self.revisions: dict[int, str] = {}
        self.trainer_logits: dict[int, torch.Tensor] = {}
        self.engine_logits: dict[tuple[str, int], torch.Tensor] = {}
        self.logits_ok: dict[tuple[str, int], bool] = {}
        self.failed = False

    def __enter__(self) -> DemoView:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def say(self, text: str) -> None:
        self.progress.console.print(text, highlight=False)

    def handle(self, event: dict[str, Any]) -> None:
        """Take one event of a role (a plain dict; see ``demo_roles`` and ``demo_model``)."""
        kind = event["kind"]
        if kind == "publisher_ready":
            layout = f", e.g. {', '.join(event['sample'])}" if "sample" in event else ""
            self.say(f"trainer: {event['tensors']} tensors over {event.get('ranks', 2)} ranks{layout}")
        elif kind == "published":
            self.revisions[event["version"]] = event["revision"]
            early = ", announced early: receivers read while the trainer digests" if event.get("early") else ""
            self.say(f"v{event['version']} published, revision {event['revision'][:12]}… "
                     f"(digests in {event['seconds'] * 1e3:.0f} ms{early})")  # fmt: skip
        elif kind == "trainer_logits":
            self.trainer_logits[event["version"]] = event["logits"]
            self._check_logits()
        elif kind == "receiver_ready":
            self._ready(event["name"], event["metrics_port"], event["total"])
        elif kind == "progress":
            if event["name"] in self.tasks:
                self.progress.update(self.tasks[event["name"]], completed=event["done"], stage=event["stage"])
        elif kind == "refit":
            self._refit(event)
        elif kind == "engine_logits":
            self.engine_logits[(event["engine"], event["version"])] = event["logits"]
            self._check_logits()
        elif kind == "error":
            self.failed = True
            self.say(f"[red]{event['role']} failed: {event['error']}[/red]")

    def _ready(self, name: str, port: int, total: int) -> None:
        self.totals[name] = total
        self.tasks[name] = self.progress.add_task(f"{name} v1/{self.versions}", total=total, gbps="  -  ",
                                                  stage="discover")  # fmt: skip
        self.say(f"rank {name}: metrics on http://127.0.0.1:{port}/metrics")

    def _good(self, event: dict[str, Any]) -> bool:
        return bool(event["committed"]) and self.revisions.get(event["version"]) == event["revision"]

    def _refit(self, event: dict[str, Any]) -> None:
        self.refits.append(event)
        name, v = event["name"], event["version"]
        ok = bool(event["committed"])  # the revision is compared at the end (events of processes race)
        self.progress.update(self.tasks[name], completed=self.totals[name], gbps=f"{event['gbps']:.2f}",
                             stage="committed" if ok else "FAILED")  # fmt: skip
        ratio = event["nbytes"] / event["ideal_bytes"] if event["ideal_bytes"] else 0.0
        kept = f"+ {event['skipped'] / 1e6:.3f} MB unchanged " if event.get("skipped") else ""  # delta refits
        self.say(
            f"v{v} {name:<9} pulled {event['nbytes'] / 1e6:8.3f} MB {kept}for a {event['ideal_bytes'] / 1e6:8.3f} MB "
            "slice "
            f"({ratio:.2f}×) in {event['seconds'] * 1e3:7.1f} ms = {event['gbps']:5.2f} GB/s, "
            f"peak staging {event['peak_staging'] / 2**20:6.1f} MiB: "
            + (f"verified, committed revision {event['revision'][:12]}…" if ok else "NOT COMMITTED")
        )
        if v < self.versions:
            description = f"{name} v{v + 1}/{self.versions}"
            self.progress.reset(self.tasks[name], total=self.totals[name], description=description)

    def _check_logits(self) -> None:
        """Compare each engine's logits with the trainer's of the same version, once both arrived."""
        for (engine, v), got in self.engine_logits.items():
            want = self.trainer_logits.get(v)
            if want is None or (engine, v) in self.logits_ok:
                continue
            same = torch.equal(got, want)
            self.logits_ok[(engine, v)] = same
            shape = "×".join(map(str, got.shape))
            self.say(
                f"v{v} engine {engine}: logits ({shape}) = the trainer's, bit-exact"
                if same
                else f"[red]v{v} engine {engine}: logits DIFFER from the trainer's "
                f"(max |Δ| {(got - want).abs().max().item():.3g})[/red]"
            )

    def ok(self) -> bool:
        """Every rank verified and committed every version with the publisher's revision; logits matched."""
        good = {(e["name"], e["version"]) for e in self.refits if self._good(e)}
        for e in self.refits:
            if e["committed"] and (e["name"], e["version"]) not in good:
                self.say(f"[red]v{e['version']} {e['name']}: committed revision {e['revision']} is not the "
                         f"publisher's {self.revisions.get(e['version'])}[/red]")  # fmt: skip
        versions = range(1, self.versions + 1)
        committed = all((n, v) in good for n in self.receivers for v in versions)
        logits = all(self.logits_ok.get((e, v)) for e in self.engines for v in versions)
        return committed and logits and not self.failed

    def table(self) -> None:
        table = Table(title="per-stage busy time, ms (mean over versions); bytes pulled against each rank's slice")
        table.add_column("rank")
        for stage in STAGES:
            table.add_column(stage, justify="right")
        for column in ("pulled MB", "slice MB", "GB/s (best)"):
            table.add_column(column, justify="right")
        for name in sorted({e["name"] for e in self.refits}):
            rows = [e for e in self.refits if e["name"] == name]
            mean = {s: sum(r["stages"].get(s, 0.0) for r in rows) / len(rows) * 1e3 for s in STAGES}
            table.add_row(name, *(f"{mean[s]:.1f}" for s in STAGES), f"{rows[-1]['nbytes'] / 1e6:.3f}",
                          f"{rows[-1]['ideal_bytes'] / 1e6:.3f}", f"{max(r['gbps'] for r in rows):.2f}")  # fmt: skip
        self.console.print(table)
