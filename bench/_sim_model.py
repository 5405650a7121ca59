"""The refit as ``bench/simulate.py`` plays it: trainer, registry and receiver pipelines on the link model.

From the trainer's go (t = 0): every trainer rank hashes its shards (``trainer_digest_gbps``) and publishes
its manifest (one registry round trip); the registry checks them one after the other (``registry_s``,
measured); the version is complete. Each receiver is told (half a round trip), fetches what it needs of the
version — the ``latest`` answer and its plan's part of the digests (``wire_bytes`` through the registry's NIC,
``registry_gbps``, shared by all) — and decodes it into its digest vector (``fetch_s``, measured), plans
(``plan_s``: 0 when the plan is cached, as from the second refit on), joins the relays (one round trip) and
then works through its segments in order:

- **pull** segment j once segment j - 1 is pulled and j - 2 verified (two buckets in flight): first its
  serial costs (``bucket_us`` and one ``latency_us`` per bucket, ``relay_bucket_us`` and a latency more per
  bucket with relayed pieces — the relay's status read after them, its bookkeeping —, ``read_us`` per
  read), then its trainer bytes (one flow per trainer GPU, all at once), then, once its upstream has
  verified the segment it needs, its relayed bytes (one flow); a reader that had to wait notices on its
  next status poll (0.2 ms doubling to 5 ms, each sleep at least ``poll_floor_ms``, then a status read:
  ``bucket_us`` + ``latency_us``; ``refit/stages/pull.py``);
- **verify** segment j once pulled and j - 1 verified, at ``verify_gbps`` (not before the digests are in,
  for a version announced early);
- after the last segment: prepare, the engine's vote, finish (``commit_ms``).

Flows take the source GPU's egress, the reader GPU's ingress, each host's NIC (``host_gbps``) and the
switch (``switch_gbps``) between hosts, max-min fair (``_sim_net``). ``host_cores`` > 0 models a host's
CPU as a resource too (the calibration box: CMA reads are CPU copies by the reader, ``cpu_copies``; hashing
is CPU, ``cpu_verify``; the serial per-bucket costs are CPU).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import numpy as np
from _sim_net import Activity, Net
from _sim_traffic import Classes, Segments, segments, upstreams

__all__ = ["Params", "Result", "simulate"]


@dataclass(frozen=True, kw_only=True)
class Params:
    gpu_gbps: float = 50.0  # per GPU NIC, each direction, GB/s (10^9 bytes a second)
    egress_limit: bool = True  # sources' NICs limit too (False: CMA on one host, where the reader copies)
    latency_us: float = 10.0  # one read round (post → completion), per bucket
    gpus_per_host: int = 8
    host_gbps: float = 0.0  # per host, each direction (0: no limit)
    switch_gbps: float = 0.0  # all traffic between hosts together (0: no limit)
    verify_gbps: float = 20.0  # a receiver's digest pass
    trainer_digest_gbps: float = 10.7  # a trainer rank's digest pass before it publishes
    bucket_us: float = 350.0  # serial cost of one bucket in the pull stage (thread hop, post, completion)
    read_us: float = 2.8  # posting cost per read (NIXL descriptor)
    relay_bucket_us: float = 1900.0  # extra serial cost of a bucket with relayed pieces (status reads, bookkeeping)
    poll_floor_ms: float = 1.0  # shortest sleep of the relay poll (asyncio: epoll's whole milliseconds)
    registry_rtt_ms: float = 0.5
    registry_gbps: float = 12.5  # the registry host's NIC (manifests to every receiver)
    registry_s: float | None = None  # the registry's checks of one version (None: measured for the scenario)
    fetch_s: float | None = None  # one receiver's decode of a version (None: measured for the scenario)
    plan_s: float = 0.0  # building the plan (0: cached, every refit after the first)
    commit_ms: float = 1.0  # prepare + the engine's vote + finish
    fixed_ms: float = 0.0  # any other per-refit cost of a receiver, found → prepared (calibration)
    host_cores: float = 0.0  # >0: hosts' CPUs are a resource (calibration box)
    cpu_copies: bool = False  # reads are CPU copies by the reader (CMA)
    cpu_verify: bool = False  # verify hashes on the host CPU
    announce_early: bool = False  # no relays: read before the digests, verify once they are in
    segments: int = 128  # segments a receiver's buckets are cut into
    byte_scale: float = 1.0  # bytes on the wire per planned byte (0.5: fp8 published instead of bf16)
    rotate: bool = False  # receivers that read only the trainer start at different segments (engine e at e / engines)
    first_use_ms: dict[int, float] = field(default_factory=dict)  # receiver → extra cost before it reads


@dataclass
class Rx:
    i: int
    engine: int
    seg: Segments
    up: Rx | None = None
    found: float = math.nan
    pulled: int = -1
    verified: int = -1
    pulling: int = -1
    verifying: int = -1
    prepared: float = math.nan
    committed: float = math.nan
    waiting: list[tuple[Rx, int]] = field(default_factory=list)
    waited_since: float = 0.0
    polling: Activity | None = None
    serial_s: float = 0.0
    bytes_in: float = 0.0
    bytes_out: float = 0.0
    phase: str = "trainer digests, publish, registry"
    since: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)


@dataclass
class Result:
    committed: float  # the trainer's go → every receiver committed
    slowest_found_to_prepared: float
    trainer_egress: float  # bytes
    engine_bytes: float  # what one engine reads: one model copy
    relay_egress_max: float
    bounds: dict[str, float]  # each resource's lower bound, seconds
    phases: dict[str, float]  # where the last receiver to commit spent its time, seconds
    complete_at: float


def _poll_wait(waited: float, p: Params) -> float:
    """Extra delay before a reader that waited ``waited`` s notices the relay is ready (its next poll)."""
    if waited <= 0:
        return 0.0
    t, sleep, lat, floor = 0.0, 2e-4, (p.latency_us + p.bucket_us) * 1e-6, p.poll_floor_ms * 1e-3
    while t < waited:
        t += (math.ceil(sleep / floor - 1e-9) * floor if floor > 0 else sleep) + lat
        sleep = min(sleep * 2, 5e-3)
    return t - waited


def _poll_duty(p: Params) -> float:
    """The share of a core a waiting reader's poll loop takes: a status read per sleep (first 8 sleeps)."""
    floor, sleeps, sleep = p.poll_floor_ms * 1e-3, [], 2e-4
    for _ in range(8):
        sleeps.append(math.ceil(sleep / floor - 1e-9) * floor if floor > 0 else sleep)
        sleep = min(sleep * 2, 5e-3)
    status = p.bucket_us * 1e-6
    return status / (status + sum(sleeps) / len(sleeps)) if status > 0 else 0.0


def _rotate(seg: Segments, by: int, scale: float) -> Segments:
    """The same segments, read starting at segment ``by`` (for readers that depend on nobody), their bytes
    times ``scale`` (a narrower dtype on the wire)."""
    roll = {k: np.roll(getattr(seg, k), -by, axis=0) for k in ("trainer", "relay", "need", "buckets",
            "relay_buckets", "reads", "nbytes", "tail")}  # fmt: skip
    for k in ("trainer", "relay", "nbytes", "tail"):
        roll[k] = roll[k] * scale
    return dataclasses.replace(seg, **roll)


def simulate(cls: Classes, p: Params, *, registry_s: float, fetch_s: float, wire_bytes: int, engines: int,
             relay: bool) -> Result:  # fmt: skip
    net, gb, rtt = Net(), 1e9, p.registry_rtt_ms * 1e-3
    ups = upstreams(cls.plans, engines, relay)
    order = list(ups)
    rx: list[Rx] = []
    for k, (e, r) in enumerate(order):
        up = ups[(e, r)]
        pair = cls.pairs.get((r, up[1])) if up is not None else None
        seg = segments(cls.plans[r], pair, cls.plans[up[1]] if up is not None else None, len(cls.trainer_bytes),
                       p.segments)  # fmt: skip
        rotate = p.rotate and not relay
        rx.append(Rx(k, e, _rotate(seg, (e * len(seg.nbytes)) // max(1, engines) if rotate else 0, p.byte_scale)))
    for k, er in enumerate(order):
        up = ups[er]
        rx[k].up = rx[order.index(up)] if up is not None else None
    n, ntrain = len(rx), int(cls.trainer_gpu.max()) + 1
    t_eg = [net.resource(f"trainer {g} egress", p.gpu_gbps * gb if p.egress_limit else 0) for g in range(ntrain)]
    r_in = [net.resource(f"receiver {k} ingress", p.gpu_gbps * gb) for k in range(n)]
    r_out = [net.resource(f"receiver {k} egress", p.gpu_gbps * gb if p.egress_limit else 0) for k in range(n)]
    r_ver = [net.resource(f"receiver {k} verify", p.verify_gbps * gb) for k in range(n)]
    hpg = max(1, p.gpus_per_host)
    hosts = -(-ntrain // hpg) + -(-n // hpg)
    h_out = [net.resource(f"host {h} out", p.host_gbps * gb) for h in range(hosts)]
    h_in = [net.resource(f"host {h} in", p.host_gbps * gb) for h in range(hosts)]
    cpu = [net.resource(f"host {h} cpu", p.host_cores) for h in range(hosts)]
    switch, registry = net.resource("switch", p.switch_gbps * gb), net.resource("registry", p.registry_gbps * gb)
    t_host = [g // hpg for g in range(ntrain)]
    r_host = [-(-ntrain // hpg) + k // hpg for k in range(n)]
    egress = np.zeros(ntrain)
    complete = float(cls.trainer_bytes.max()) * p.byte_scale / (p.trainer_digest_gbps * gb) + rtt + registry_s
    digest_ready = complete + rtt / 2 + fetch_s if p.announce_early else 0.0
    start_at = rtt + registry_s if p.announce_early else complete

    def mark(x: Rx, phase: str) -> None:
        x.phases[x.phase] = x.phases.get(x.phase, 0.0) + net.now - x.since
        x.phase, x.since = phase, net.now

    def path(src_host: int, dst: int) -> list[tuple[int, float]]:
        uses = [(r_in[dst], 1.0)]
        if src_host != r_host[dst]:
            uses += [(h_out[src_host], 1.0), (h_in[r_host[dst]], 1.0), (switch, 1.0)]
        if p.cpu_copies:
            uses.append((cpu[r_host[dst]], 1.0 / (p.gpu_gbps * gb)))
        return uses

    def try_pull(x: Rx) -> None:
        j, s = x.pulled + 1, x.seg
        if x.pulling >= j or j >= len(s.nbytes) or x.verified < j - 2:
            return
        x.pulling = j
        mark(x, "per-bucket costs")
        cpu_s = (s.buckets[j] * p.bucket_us + s.relay_buckets[j] * p.relay_bucket_us + s.reads[j] * p.read_us) * 1e-6
        lat = (s.buckets[j] + s.relay_buckets[j]) * p.latency_us * 1e-6
        x.serial_s += cpu_s + lat
        uses = ((cpu[r_host[x.i]], cpu_s / (cpu_s + lat)),) if p.host_cores and cpu_s + lat > 0 else ()
        net.start(Activity(cpu_s + lat, uses, lambda now: trainer_part(x, j), cap=1.0))

    def trainer_part(x: Rx, j: int) -> None:
        gpus = np.bincount(cls.trainer_gpu, weights=x.seg.trainer[j], minlength=ntrain)
        todo = np.flatnonzero(gpus > 0).tolist()
        left = [len(todo)]

        def one_done(now: float) -> None:
            left[0] -= 1
            if left[0] == 0:
                relay_part(x, j)

        if not todo:
            relay_part(x, j)
            return
        mark(x, "trainer reads")
        for g in todo:
            egress[g] += gpus[g]
            x.bytes_in += gpus[g]
            net.start(Activity(float(gpus[g]), tuple([(t_eg[g], 1.0), *path(t_host[g], x.i)]), one_done))

    def relay_part(x: Rx, j: int) -> None:
        if x.seg.relay[j] <= 0:
            pulled(x, j)
        elif x.up is not None and x.up.verified >= x.seg.need[j]:
            relay_flow(x, j)
        else:
            assert x.up is not None
            mark(x, "waiting for its relay")
            x.up.waiting.append((x, j))
            x.waited_since = net.now
            if p.host_cores:  # the poll loop's status reads take CPU while it waits
                x.polling = Activity(1e18, ((cpu[r_host[x.i]], 1.0),), lambda now: None, cap=_poll_duty(p))
                net.start(x.polling)

    def relay_flow(x: Rx, j: int) -> None:
        up, b = x.up, float(x.seg.relay[j])
        assert up is not None
        mark(x, "relay reads")
        up.bytes_out += b
        x.bytes_in += b
        net.start(Activity(b, tuple([(r_out[up.i], 1.0), *path(r_host[up.i], x.i)]), lambda now: pulled(x, j)))

    def pulled(x: Rx, j: int) -> None:
        x.pulled = j
        mark(x, "verify (pull waits for it)" if j < len(x.seg.nbytes) - 1 else "verify of the last segment")
        try_verify(x)
        try_pull(x)

    def try_verify(x: Rx) -> None:
        j = x.verified + 1
        if x.verifying >= j or j > x.pulled:
            return
        x.verifying = j
        uses = [(r_ver[x.i], 1.0)] + ([(cpu[r_host[x.i]], 1.0 / (p.verify_gbps * gb))] if p.cpu_verify else [])
        act = Activity(float(x.seg.nbytes[j]), tuple(uses), lambda t: verified(x, j))
        net.at(max(net.now, digest_ready), lambda now: net.start(act))

    def verified(x: Rx, j: int) -> None:
        x.verified = j
        woken = [w for w in x.waiting if j >= w[0].seg.need[w[1]]]
        x.waiting = [w for w in x.waiting if w not in woken]
        for y, k in woken:
            delay = _poll_wait(net.now - y.waited_since, p)
            if y.polling is not None:
                poll, y.polling = y.polling, None
                net.at(net.now + delay, lambda now, poll=poll: net.stop(poll))
            net.at(net.now + delay, lambda now, y=y, k=k: relay_flow(y, k))
        if j < len(x.seg.nbytes) - 1:
            try_verify(x)
            try_pull(x)
            return
        mark(x, "prepare, vote, commit")
        x.prepared = net.now + p.fixed_ms * 1e-3
        mates = [y for y in rx if y.engine == x.engine]
        if all(not math.isnan(y.prepared) for y in mates):
            for y in mates:
                y.committed = max(z.prepared for z in mates) + p.commit_ms * 1e-3

    def found(x: Rx) -> None:
        x.found = net.now
        mark(x, "plan, join")
        first = p.first_use_ms.get(x.i, 0.0) * 1e-3
        net.at(net.now + p.plan_s + (rtt if relay else 0.0) + first, lambda now: try_pull(x))

    def fetch(x: Rx) -> None:
        mark(x, "fetch, decode")
        net.start(Activity(float(wire_bytes), ((registry, 1.0),), lambda now: fetched(x)))

    def fetched(x: Rx) -> None:
        net.at(net.now + fetch_s, lambda t: found(x))

    for x in rx:
        net.at(start_at + rtt / 2, lambda now, x=x: fetch(x))
    net.run()
    for x in rx:
        net.now = x.committed
        mark(x, "")
    last = max(rx, key=lambda x: (x.committed, x.prepared))  # the engine's slowest rank, not one that waited
    bounds = {
        "trainer egress": float(egress.max()) / (p.gpu_gbps * gb),
        "receiver ingress": max(x.bytes_in for x in rx) / (p.gpu_gbps * gb),
        "relay egress": max(x.bytes_out for x in rx) / (p.gpu_gbps * gb),
        "verify": max(float(x.seg.nbytes.sum()) for x in rx) / (p.verify_gbps * gb),
        "per-bucket costs": max(x.serial_s for x in rx),
        "registry NIC": wire_bytes * n / (p.registry_gbps * gb),
    }
    engine = sum(float(pl.bucket_bytes.sum()) for pl in cls.plans) * p.byte_scale
    phases = {k: v for k, v in last.phases.items() if k}
    slowest = max(x.prepared - x.found for x in rx)
    return Result(last.committed, slowest, float(egress.sum()), engine, max(x.bytes_out for x in rx), bounds, phases,
                  complete)  # fmt: skip
