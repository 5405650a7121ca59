"""What the demo shows: live progress bars per receiver, a line per refit, a per-stage table at the end."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table

from refitflow.metrics import STAGES

__all__ = ["DemoView"]


class DemoView:
    def __init__(self, total_bytes: int, versions: int, console: Console | None = None) -> None:
        self.console = console or Console()
        self.total, self.versions = total_bytes, versions
        self.progress = Progress(
            TextColumn("{task.description:<22}"), BarColumn(), DownloadColumn(binary_units=False),
            TextColumn("{task.fields[gbps]:>6} GB/s  {task.fields[stage]:<9}"), TimeElapsedColumn(),
            console=self.console, transient=False,
        )  # fmt: skip
        self.tasks: dict[str, TaskID] = {}
        self.version: dict[str, int] = {}
        self.refits: list[dict[str, Any]] = []
        self.revisions: dict[int, str] = {}

    def __enter__(self) -> DemoView:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def say(self, text: str) -> None:
        self.progress.console.print(text)

    def receiver_ready(self, name: str, port: int) -> None:
        self.version[name] = 1
        self.tasks[name] = self.progress.add_task(
            f"{name} v1/{self.versions}", total=self.total, gbps="  -  ", stage="discover"
        )
        self.say(f"receiver {name}: metrics on http://127.0.0.1:{port}/metrics")

    def progress_event(self, name: str, stage: str, done: int) -> None:
        if name in self.tasks:
            self.progress.update(self.tasks[name], completed=done, stage=stage)

    def refit_event(self, event: dict[str, Any]) -> None:
        self.refits.append(event)
        name, v = event["name"], event["version"]
        ok = event["committed"] and self.revisions.get(v) == event["revision"]
        self.progress.update(
            self.tasks[name], completed=self.total, gbps=f"{event['gbps']:.2f}", stage="committed" if ok else "FAILED"
        )
        self.say(
            f"v{v} {name:<9} {event['nbytes'] / 1e9:.3f} GB in {event['seconds'] * 1e3:7.1f} ms "
            f"= {event['gbps']:5.2f} GB/s  peak staging {event['peak_staging'] / 2**20:6.1f} MiB  "
            + ("verified, committed" if ok else "NOT COMMITTED / REVISION MISMATCH")
        )
        if v < self.versions:
            self.progress.reset(self.tasks[name], total=self.total, description=f"{name} v{v + 1}/{self.versions}")

    def ok(self, receivers: list[str]) -> bool:
        """Every receiver verified and committed every version, with the publisher's revision."""
        good = {(e["name"], e["version"]) for e in self.refits if e["committed"]
                and self.revisions.get(e["version"]) == e["revision"]}  # fmt: skip
        return all((n, v) in good for n in receivers for v in range(1, self.versions + 1))

    def table(self) -> None:
        table = Table(title="per-stage busy time, ms (mean over versions)")
        table.add_column("receiver")
        for stage in STAGES:
            table.add_column(stage, justify="right")
        table.add_column("GB/s (best)", justify="right")
        for name in sorted({e["name"] for e in self.refits}):
            rows = [e for e in self.refits if e["name"] == name]
            mean = {s: sum(r["stages"].get(s, 0.0) for r in rows) / len(rows) * 1e3 for s in STAGES}
            table.add_row(name, *(f"{mean[s]:.1f}" for s in STAGES), f"{max(r['gbps'] for r in rows):.2f}")
        self.console.print(table)
