"""docs/grafana/refitflow.json queries only what a real refit exports, and shows every metric refitflow has.

A trainer rank and a receiving rank refit two versions over NIXL through a registry service (one
process); both serve their metrics over HTTP, and the scrape is read the way Prometheus reads it.
"""

from __future__ import annotations

import json
import pathlib
import re
import urllib.request

import anyio
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

import refitflow as rf
from refitflow.metrics.prometheus import PrometheusMetrics
from tests.conftest import mlp

DASHBOARD = pathlib.Path(__file__).resolve().parents[2] / "docs" / "grafana" / "refitflow.json"
SCRAPE_LABELS = {"instance", "job", "le", "__name__"}  # added by Prometheus, or part of every histogram


def _queries(dashboard: dict) -> list[str]:
    found = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    found += [v["query"]["query"] for v in dashboard["templating"]["list"] if isinstance(v.get("query"), dict)]
    return found


def _scrape(port: int) -> dict[str, list[dict[str, str]]]:
    """Every sample name in the exposition, with the label sets it carries (its value as label ``=``)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out: dict[str, list[dict[str, str]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append({**sample.labels, "=": str(sample.value)})
    return out


async def _real_refit() -> dict[str, list[dict[str, str]]]:
    ident = rf.Identity(model="dashboard")
    recv_metrics, pub_metrics = PrometheusMetrics(), PrometheusMetrics()
    ports = [recv_metrics.serve(), pub_metrics.serve()]
    trainer = mlp(1, dtype=torch.bfloat16)  # bf16 into fp32: staged, so every stage carries bytes
    try:
        with anyio.fail_after(60):
            async with rf.Registry.serve("tcp://127.0.0.1:*") as server:
                async with (
                    rf.Publisher(server.address, identity=ident, observer=pub_metrics) as pub,
                    rf.Receiver(mlp(2), server.address, identity=ident, observer=recv_metrics, budget_bytes=8192) as rx,
                ):
                    for version in (1, 2):
                        await pub.publish(version, dict(trainer.named_parameters()))
                        await rx.refit(version)
                        await pub.released(version, timeout=10)
                        with torch.no_grad():
                            for p in trainer.parameters():
                                p.add_(1)
        scraped: dict[str, list[dict[str, str]]] = {}
        for port in ports:
            for name, labels in _scrape(port).items():
                scraped.setdefault(name, []).extend(labels)
        return scraped
    finally:
        recv_metrics.close()
        pub_metrics.close()


@pytest.mark.asyncio
async def test_dashboard_queries_only_metrics_a_real_refit_exports() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    scraped = await _real_refit()
    assert {"=": "2.0"} in scraped["refitflow_committed_version"]  # the receiver's: the refits happened
    assert {"=": "2.0"} in scraped["refitflow_published_versions_total"]  # the publisher's
    queries = _queries(dashboard)
    assert len(queries) >= 15
    for query in queries:
        names = set(re.findall(r"\brefitflow_[a-z0-9_]+\b", query))
        assert names, f"no refitflow metric in {query!r}"
        for name in names:
            if f'{name}="' in query and name not in scraped:
                continue  # a label of that name (refitflow_fence_state="fenced"), checked below
            assert name in scraped, f"{name} (in {query!r}) is not in the scrape"
        labelled = [scraped[n] for n in names if n in scraped]
        for label, value in re.findall(r'(\w+)\s*=~?\s*"([^"$]*)"', query):  # matchers, variables aside
            if label not in SCRAPE_LABELS:
                assert any(s.get(label) == value for samples in labelled for s in samples), f"{label}={value!r}"
        for group in re.findall(r"\bby \(([^)]*)\)", query):
            for label in {g.strip() for g in group.split(",")} - SCRAPE_LABELS:
                assert any(label in s for samples in labelled for s in samples), f"no label {label!r} in {query!r}"


@pytest.mark.asyncio
async def test_dashboard_shows_every_metric_refitflow_exports() -> None:
    text = DASHBOARD.read_text()
    scraped = await _real_refit()
    families = {re.sub(r"_(bucket|count|sum|created)$", "", n) for n in scraped if n.startswith("refitflow_")}
    missing = sorted(f for f in families if f not in text)
    assert not missing, f"metrics refitflow exports that the dashboard does not show: {missing}"
