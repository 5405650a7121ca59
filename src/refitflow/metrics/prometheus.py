"""Prometheus metrics for one receiver or publisher, in a registry of its own.

Serve them over HTTP (``serve()``, loopback by default), or hand ``registry`` to a host server
(``prometheus_client.make_asgi_app(metrics.registry)``, or register it into the host's own registry).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Enum, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from refitflow.metrics import BYTE_KINDS, FRAME_KINDS, OUTCOMES, STAGES, NullObserver, QueueStats

__all__ = ["PrometheusMetrics"]

_SECONDS = (1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0)
TRANSPORTS = ("loopback", "nixl", "stream")


class _QueueCollector(Collector):
    def __init__(self) -> None:
        self.queues: Mapping[str, QueueStats] = {}

    def collect(self) -> Iterator[GaugeMetricFamily]:
        depth = GaugeMetricFamily("refitflow_queue_depth", "Items waiting between stages", labels=["queue"])
        cap = GaugeMetricFamily("refitflow_queue_capacity", "Capacity of the queue between stages", labels=["queue"])
        for name in STAGES[1:]:
            used, size = self.queues[name]() if name in self.queues else (0, 0)
            depth.add_metric([name], used)
            cap.add_metric([name], size)
        yield depth
        yield cap


class _ServedCollector(Collector):
    """Bytes peers read from this rank, as its transport counts them (absent if it cannot)."""

    def __init__(self) -> None:
        self.source: Callable[[], int | None] = lambda: None

    def collect(self) -> Iterator[CounterMetricFamily]:
        served = self.source()
        if served is not None:
            yield CounterMetricFamily(
                "refitflow_publisher_served_bytes", "Bytes peers read from this rank", value=served
            )


class PrometheusMetrics(NullObserver):
    """An ``Observer`` that exports everything a receiver or publisher reports."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.items = Counter("refitflow_stage_items", "Items that left each stage", ["stage"], registry=r)
        self.bytes = Counter("refitflow_stage_bytes", "Bytes carried out of each stage", ["stage"], registry=r)
        self.in_flight = Gauge("refitflow_stage_in_flight", "Items inside each stage", ["stage"], registry=r)
        self.duration = Histogram(
            "refitflow_stage_duration_seconds", "Busy time per item", ["stage"], buckets=_SECONDS, registry=r
        )
        self.transport_bytes = Counter(
            "refitflow_transport_read_bytes", "Bytes read through the transport", ["transport"], registry=r
        )
        self.read_latency = Histogram(
            "refitflow_transport_read_seconds", "Latency of one batch of reads", ["transport"],
            buckets=_SECONDS, registry=r,
        )  # fmt: skip
        self.budget_capacity = Gauge("refitflow_budget_capacity_bytes", "Staging budget", registry=r)
        self.budget_used = Gauge("refitflow_budget_used_bytes", "Staging bytes held", registry=r)
        self.budget_peak = Gauge("refitflow_budget_peak_bytes", "Peak staging bytes in the last refit", registry=r)
        self.fence = Enum(
            "refitflow_fence_state", "Serving gate of the rank", states=["ready", "updating", "fenced"], registry=r
        )
        self.committed_version = Gauge("refitflow_committed_version", "Version being served", registry=r)
        self.last_commit = Gauge("refitflow_last_commit_timestamp_seconds", "Unix time of the last commit", registry=r)
        self.refits = Counter("refitflow_refits", "Refits by outcome", ["outcome"], registry=r)
        self.frames_refused = Counter(
            "refitflow_stream_frames_refused", "Push-stream frames refused, by reason", ["kind"], registry=r
        )
        self.refit_bytes_ = Counter(
            "refitflow_refit_bytes", "Refit bytes skipped (delta), re-hashed, repaired, relayed or rerouted", ["kind"],
            registry=r,
        )  # fmt: skip
        self.published = Counter("refitflow_published_versions", "Versions published", registry=r)
        self.published_bytes = Counter("refitflow_published_bytes", "Bytes of the versions published", registry=r)
        self.acked = Gauge("refitflow_publisher_receivers_acked", "Receivers done with the last version", registry=r)
        self.receivers = Gauge("refitflow_publisher_receivers", "Receivers registered for this model", registry=r)
        self._queues = _QueueCollector()
        self._served = _ServedCollector()
        r.register(self._queues)
        r.register(self._served)
        # known label values exist from the start; their children are kept: every bucket reports to every stage
        # (``labels()`` takes a lock and builds a key each call: ~10 µs a stage a bucket, against ~2 µs)
        self._stages: dict[str, tuple[Counter, Counter, Gauge, Histogram]] = {}
        self._transports: dict[str, tuple[Counter, Histogram]] = {}
        for stage in STAGES:
            self._stage(stage)
        for outcome in OUTCOMES:
            self.refits.labels(outcome=outcome)
        for kind in FRAME_KINDS:
            self.frames_refused.labels(kind=kind)
        for kind in BYTE_KINDS:
            self.refit_bytes_.labels(kind=kind)
        for transport in TRANSPORTS:
            self._transport(transport)
        self.fence.state("ready")
        self._server: Any = None

    # Observer
    def _stage(self, stage: str) -> tuple[Counter, Counter, Gauge, Histogram]:
        """``stage``'s children of the stage metrics, made on first use (a stage refitflow does not name too)."""
        found = self._stages.get(stage)
        if found is None:
            items, nbytes = self.items.labels(stage=stage), self.bytes.labels(stage=stage)
            found = self._stages[stage] = (items, nbytes, self.in_flight.labels(stage=stage),
                                           self.duration.labels(stage=stage))  # fmt: skip
        return found

    def _transport(self, transport: str) -> tuple[Counter, Histogram]:
        found = self._transports.get(transport)
        if found is None:
            found = self._transports[transport] = (self.transport_bytes.labels(transport=transport),
                                                   self.read_latency.labels(transport=transport))  # fmt: skip
        return found

    def stage_enter(self, stage: str) -> None:
        self._stage(stage)[2].inc()

    def stage_item(self, stage: str, nbytes: int, seconds: float) -> None:
        items, nbytes_, in_flight, duration = self._stage(stage)
        items.inc()
        nbytes_.inc(nbytes)
        duration.observe(seconds)
        in_flight.dec()

    def transport_read(self, transport: str, nbytes: int, seconds: float) -> None:
        read_bytes, latency = self._transport(transport)
        read_bytes.inc(nbytes)
        latency.observe(seconds)

    def queues(self, queues: Mapping[str, QueueStats]) -> None:
        self._queues.queues = dict(queues)
        if not queues:
            for children in self._stages.values():  # items abandoned by an aborted refit are no longer in flight
                children[2].set(0)

    def fence_state(self, state: str) -> None:
        self.fence.state(state)

    def refit_outcome(self, outcome: str, version: int | None) -> None:
        self.refits.labels(outcome=outcome).inc()
        if outcome == "committed" and version is not None:
            self.committed_version.set(version)
            self.last_commit.set(time.time())

    def budget(self, used_bytes: int, peak_bytes: int, capacity_bytes: int) -> None:
        self.budget_used.set(used_bytes)
        self.budget_peak.set(peak_bytes)
        self.budget_capacity.set(capacity_bytes)

    def frame_refused(self, kind: str) -> None:
        self.frames_refused.labels(kind=kind).inc()

    def refit_bytes(self, kind: str, nbytes: int) -> None:
        self.refit_bytes_.labels(kind=kind).inc(nbytes)

    # publisher side
    def version_published(self, version: int, nbytes: int) -> None:
        self.published.inc()
        self.published_bytes.inc(nbytes)

    def receivers_acked(self, done: int, registered: int) -> None:
        self.acked.set(done)
        self.receivers.set(registered)

    def watch_served(self, served_bytes: Callable[[], int | None]) -> None:
        self._served.source = served_bytes

    # exposition
    def serve(self, port: int = 0, addr: str = "127.0.0.1") -> int:
        """Serve ``/metrics`` over HTTP on ``addr:port`` (0 = any free port); return the port."""
        if self._server is None:
            self._server, _ = start_http_server(port, addr=addr, registry=self.registry)
        return int(self._server.server_port)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
