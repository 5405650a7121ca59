"""Prometheus metrics of a receiver and a publisher, scraped over HTTP from a real server."""

from __future__ import annotations

import urllib.request

import anyio
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

import refitflow as rf
from refitflow.metrics import BYTE_KINDS, STAGES
from refitflow.metrics.prometheus import PrometheusMetrics
from tests.conftest import InjectedFailure, mlp


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def fence(samples: dict) -> str:
    states = [dict(k[1])["refitflow_fence_state"] for k, v in samples.items() if k[0] == "refitflow_fence_state" and v]
    assert len(states) == 1
    return states[0]


@pytest.mark.asyncio
async def test_receiver_and_publisher_metrics_after_a_refit(ident, registry) -> None:
    recv_metrics, pub_metrics = PrometheusMetrics(), PrometheusMetrics()
    r_port, p_port = recv_metrics.serve(), pub_metrics.serve()
    try:
        before = scrape(r_port)
        for stage in STAGES:  # every known label value exists from the start
            assert before[("refitflow_stage_items_total", (("stage", stage),))] == 0
        assert {before[("refitflow_refits_total", (("outcome", o),))] for o in ("committed", "aborted", "refused")} == {
            0
        }
        trainer = mlp(1, dtype=torch.bfloat16)  # staged: every stage carries bytes
        with anyio.fail_after(20):
            async with (
                rf.Publisher(registry, identity=ident, observer=pub_metrics) as pub,
                rf.Receiver(mlp(2), registry, identity=ident, observer=recv_metrics, budget_bytes=8192) as recv,
            ):
                m = await pub.publish(4, dict(trainer.named_parameters()))
                result = await recv.refit(4)
                await pub.released(4, timeout=5)
        after = scrape(r_port)
        nbytes = sum(s.nbytes for s in m.shards)
        assert after[("refitflow_stage_bytes_total", (("stage", "verify"),))] == result.nbytes == nbytes
        assert after[("refitflow_stage_items_total", (("stage", "pull"),))] == result.stages["pull"].items > 1
        assert after[("refitflow_stage_duration_seconds_count", (("stage", "apply"),))] == result.stages["apply"].items
        assert all(after[("refitflow_stage_in_flight", (("stage", s),))] == 0 for s in STAGES)
        assert after[("refitflow_transport_read_bytes_total", (("transport", "loopback"),))] == nbytes
        assert after[("refitflow_refits_total", (("outcome", "committed"),))] == 1
        assert after[("refitflow_committed_version", ())] == 4
        assert after[("refitflow_last_commit_timestamp_seconds", ())] > 0
        assert after[("refitflow_budget_capacity_bytes", ())] == 8192
        assert 0 < after[("refitflow_budget_peak_bytes", ())] <= 8192
        assert after[("refitflow_budget_used_bytes", ())] == 0
        assert after[("refitflow_queue_capacity", (("queue", "pull"),))] == 0  # no refit running
        assert fence(after) == "ready"
        pub_side = scrape(p_port)
        assert pub_side[("refitflow_published_versions_total", ())] == 1
        assert pub_side[("refitflow_published_bytes_total", ())] == nbytes
        assert pub_side[("refitflow_publisher_served_bytes_total", ())] == nbytes  # loopback counts real reads
        assert pub_side[("refitflow_publisher_receivers_acked", ())] == 1
    finally:
        recv_metrics.close()
        pub_metrics.close()


class FailingMetrics(PrometheusMetrics):
    """Real metrics, plus a failure injected after the first apply (so the rank is fenced)."""

    def __init__(self) -> None:
        super().__init__()
        self.fences: list[str] = []
        self.fail = True

    def fence_state(self, state: str) -> None:
        super().fence_state(state)
        self.fences.append(state)

    def stage_item(self, stage: str, nbytes: int, seconds: float) -> None:
        super().stage_item(stage, nbytes, seconds)
        if stage == "apply" and self.fail:
            self.fail = False
            raise InjectedFailure("apply failed")


@pytest.mark.asyncio
async def test_fence_gauge_follows_updating_ready_and_fenced(ident, registry) -> None:
    metrics = FailingMetrics()
    port = metrics.serve()
    try:
        with anyio.fail_after(20):
            async with (
                rf.Publisher(registry, identity=ident) as pub,
                rf.Receiver(mlp(2), registry, identity=ident, observer=metrics, budget_bytes=4096) as recv,
            ):
                await pub.publish(1, dict(mlp(1, dtype=torch.bfloat16).named_parameters()))
                with pytest.raises(rf.RefitError):
                    await recv.refit(1)
                fenced = scrape(port)
                await pub.publish(2, dict(mlp(3, dtype=torch.bfloat16).named_parameters()))
                await recv.refit(2)
                ready = scrape(port)
    finally:
        metrics.close()
    assert metrics.fences == ["updating", "fenced", "updating", "ready"]
    assert fence(fenced) == "fenced" and fence(ready) == "ready"
    assert fenced[("refitflow_refits_total", (("outcome", "aborted"),))] == 1
    assert ready[("refitflow_refits_total", (("outcome", "committed"),))] == 1
    assert all(ready[("refitflow_stage_in_flight", (("stage", s),))] == 0 for s in STAGES)


@pytest.mark.asyncio
async def test_skipped_and_re_hashed_bytes_of_delta_refits_are_counted(ident, registry) -> None:
    metrics = PrometheusMetrics()
    port = metrics.serve()
    try:
        trainer = mlp(1)
        assert {scrape(port)[("refitflow_refit_bytes_total", (("kind", k),))] for k in BYTE_KINDS} == {0}
        with anyio.fail_after(20):
            async with (
                rf.Publisher(registry, identity=ident) as pub,
                rf.Receiver(mlp(2), registry, identity=ident, observer=metrics, recheck_fraction=1.0) as recv,
            ):
                for version in (1, 2):  # the same bytes twice: the second refit pulls nothing
                    await pub.publish(version, dict(trainer.named_parameters()))
                    result = await recv.refit(version)
        after = scrape(port)
        assert result.nbytes == 0 and result.skipped_bytes == result.rechecked_bytes > 0
        assert after[("refitflow_refit_bytes_total", (("kind", "skipped"),))] == result.skipped_bytes
        assert after[("refitflow_refit_bytes_total", (("kind", "rechecked"),))] == result.rechecked_bytes
        assert after[("refitflow_refit_bytes_total", (("kind", "relayed"),))] == 0
    finally:
        metrics.close()
