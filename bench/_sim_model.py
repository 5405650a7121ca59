"""The refit as ``bench/simulate.py`` plays it: trainer, registry and receiver pipelines on the link model.

From the trainer's go (t = 0): every trainer rank hashes its shards (on the device: ``device_verify_gbps``;
on the host: ``trainer_digest_gbps``) and publishes its version's record (its layout was sent once; one
registry round trip); the registry checks the records one after the other against their layouts
(``registry_s``, measured with the registry's code: ``_sim_costs``); the version is complete. With
``announce_early`` (the publisher's auto mode when every byte changed) each rank first announces its record
without digests (its layout's id alone: ``pending_s`` of the registry's work, measured) and receivers that read
only the trainer start then, verifying once the digests are in. Each receiver is told (half a round trip),
fetches what it needs of the version — the
``latest`` answer and its plan's part of the digests (``wire_bytes``: ``Costs.wire_bytes(part)``, through the
registry's NIC, ``registry_gbps``, shared by all) — and decodes it into its digest vector (``fetch_s``:
``Costs.fetch_s(part)``, measured), plans (``plan_s``: 0 once cached), joins the relays (one round trip) and
works through its segments in order:

- **pull**: a serial lane posts segment j — ``bucket_us`` per bucket (refitflow's own cost: stages, hops,
  completions), ``relay_bucket_us`` more per bucket with relayed pieces, ``read_us`` per read (the transport's
  cost of a descriptor in a prepared transfer) — while earlier segments' bytes flow: with a ``window`` of W > 1
  buckets in flight a segment's bytes start one bucket's post (and ``latency_us``) after its post begins, and
  the lane posts the next segment while they flow (at most two segments in flight); W = 1 (one bucket in
  flight: the code before issue 51) posts, then reads the trainer's bytes, then the relay's, then the next.
  A segment's trainer bytes are one flow over every trainer GPU it reads (each GPU's NIC taken in proportion
  to its share), after the receiver's earlier segments' (peers serve reads in order); relayed bytes one flow
  from the upstream, likewise in order, once it has verified
  the segment they need; a reader that waited notices at its next status poll (the code's sleeps,
  ``refit.fanout.reading.poll_sleeps``: paced by its waits so far, each sleep at least ``poll_floor_ms``, then
  a status read of ``status_us`` (else ``bucket_us``) + ``latency_us``), or after ``latency_us`` were progress
  pushed (``relay_push``, not built).
- **verify** segment j once pulled and j - 1 verified, on the device (``device_verify_gbps``: no host copy,
  no CPU) or on the host (``verify_gbps``); pull runs at most two segments ahead of verify. A version announced
  before its digests is hashed as it lands and each segment's hashes held (as ``refit/stages/verify.py`` does):
  only the last segment waits for the digests;
- after the last segment: prepare, the engine's vote, finish (``commit_ms``).

Flows take the source GPU's egress, the reader GPU's ingress, each host's NIC (``host_gbps``) and the switch
(``switch_gbps``) between hosts, max-min fair in each activity's dominant share (``_sim_net``). ``host_cores``
> 0 models a host's CPU as a resource too (the calibration box: CMA reads are CPU copies by the reader,
``cpu_copies``; host hashing is CPU, ``cpu_verify``; the serial lane is CPU, and on it a receiver's upkeep:
``cpu_ms`` a version — its threads' hand-offs, the registry's round trips — ``relay_cpu_ms`` more for a relaying
one (its status words, its progress thread while it is read) and ``reader_cpu_ms`` more for one that reads a relay
(its relayed reads prepared anew for an upstream it did not read last version, the wake-ups of its waits)).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
from _sim_net import Activity, Net
from _sim_traffic import Classes, Segments, segments, upstreams

from refitflow.refit.config import ReceiverConfig
from refitflow.refit.fanout.reading import averaged, poll_sleeps

__all__ = ["DEVICE_GBPS", "TODAY", "WINDOW", "Params", "Result", "simulate"]

_CFG = ReceiverConfig()
assert _CFG.window_buckets is not None
WINDOW = _CFG.window_buckets  # issue 51's pull window with the default limits (the budget over a bucket: 8)
DEVICE_GBPS = {"conservative": 100.0, "optimistic": 1000.0}  # a GPU's digest rate until bench/gpu_check.py measures it
# the data path of the code before issue 51 (main at ca21faa): one bucket in flight, device bytes hashed on the
# host (xxh3 through a bounce buffer), relay progress polled with a status read, and that code's costs a bucket
# (354 us: bench/bucket_cost.py then) and a relayed bucket (1,900 us: stop 45's calibration)
TODAY: dict[str, object] = {"window": 1, "device_digests": False, "relay_push": False, "bucket_us": 354.0,
                            "relay_bucket_us": 1900.0}  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class Params:
    gpu_gbps: float = 50.0  # per GPU NIC, each direction, GB/s (10^9 bytes a second)
    egress_limit: bool = True  # sources' NICs limit too (False: CMA on one host, where the reader copies)
    latency_us: float = 10.0  # a read's round trip on the network (post → completion); the window overlaps it
    gpus_per_host: int = 8
    host_gbps: float = 0.0  # per host, each direction (0: no limit)
    switch_gbps: float = 0.0  # all traffic between hosts together (0: no limit)
    window: int = WINDOW  # buckets in flight per rank in the pull stage (1: one at a time, the code before issue 51)
    device_digests: bool = True  # digests and verify of device tensors on the device (no host copy, no CPU)
    device_verify_gbps: float = DEVICE_GBPS["conservative"]  # a GPU's digest rate (verify and the trainer's pass)
    verify_gbps: float = 20.0  # host digest rate of a receiver (xxh3 on a core): device_digests False
    trainer_digest_gbps: float = 10.7  # host digest pass of a trainer rank: device_digests False
    # refitflow's own serial cost of a bucket: bench/bucket_cost.py in the calibration of 2026-12-05 10:15 (the
    # larger of that day's two: 41 and 29 us); the calib measures it again
    bucket_us: float = 41.0
    read_us: float = 2.8  # the transport's cost of one descriptor (raw NIXL here, docs/benchmarks.md)
    # extra serial cost of a bucket with relayed pieces: bench/relay_cost.py on 2026-12-05 (the largest of its
    # runs: -30 ... 35 us; the calibration's 9 and 4); the calib measures it again
    relay_bucket_us: float = 35.0
    # a reader close behind its relay polls its status while it waits (refit/fanout/reading.py: what the code does;
    # a reader behind it reads on from the last status read); True: progress pushed (not built: a what-if)
    relay_push: bool = False
    poll_floor_ms: float = 1.0  # shortest sleep of the relay poll (asyncio: epoll's whole milliseconds)
    registry_rtt_ms: float = 0.5
    registry_gbps: float = 12.5  # the registry host's NIC (manifests to every receiver)
    registry_s: float | None = None  # the registry's checks of one version (None: measured for the scenario)
    fetch_s: float | None = None  # one receiver's decode of a version (None: measured for the scenario)
    plan_s: float = 0.0  # building the plan (0: cached, every refit after the first)
    commit_ms: float = 1.0  # prepare + the engine's vote + finish
    fixed_ms: float = 0.0  # any other per-refit cost of a receiver, found → prepared (calibration)
    host_cores: float = 0.0  # >0: hosts' CPUs are a resource (calibration box)
    cpu_ms: float = 0.0  # a receiver's CPU a version beyond its buckets' and bytes' (calibration box)
    relay_cpu_ms: float = 0.0  # a relaying receiver's more (calibration box)
    reader_cpu_ms: float = 0.0  # and more again for one that reads a relay (calibration box)
    status_us: float = 0.0  # a relay status read's CPU (0: ``bucket_us``)
    cpu_copies: bool = False  # reads are CPU copies by the reader (CMA)
    cpu_verify: bool = False  # host verify takes CPU
    announce_early: bool = True  # no relays: read before the digests (the publisher's auto mode when all bytes change)
    segments: int = 128  # segments a receiver's buckets are cut into
    rotate: bool = True  # receivers that read only the trainer start at e / engines of their slice (VllmFleet.init)

    @property
    def digest_gbps(self) -> tuple[float, float]:
        """(a receiver's verify, a trainer rank's digest pass), GB/s."""
        if self.device_digests:
            return self.device_verify_gbps, self.device_verify_gbps
        return self.verify_gbps, self.trainer_digest_gbps


@dataclass
class Rx:
    i: int
    engine: int
    seg: Segments
    up: Rx | None = None
    found: float = math.nan
    post_next: int = 0  # the next segment the lane posts
    posting: bool = False
    posted: int = -1
    left: dict[int, int] = field(default_factory=dict)  # segment in flight → parts not yet done
    tleft: dict[int, int] = field(default_factory=dict)  # segment in flight → trainer flows not yet done
    waits: set[int] = field(default_factory=set)  # segments waiting for their upstream
    relaying: set[int] = field(default_factory=set)  # segments whose relayed bytes flow (or queue)
    queue: dict[str, deque[Activity]] = field(default_factory=dict)  # flows waiting for the earlier ones, per lane
    busy: set[str] = field(default_factory=set)  # lanes with a flow running
    arrived: set[int] = field(default_factory=set)  # segments done, not yet in the pulled prefix
    pulled: int = -1
    verified: int = -1
    verifying: int = -1
    prepared: float = math.nan
    committed: float = math.nan
    waiting: list[tuple[Rx, int]] = field(default_factory=list)  # readers waiting for this relay
    waited_since: dict[int, float] = field(default_factory=dict)
    pace: float = 0.0  # its waits for its relay, averaged as the code does
    polling: Activity | None = None
    serial: dict[str, float] = field(default_factory=dict)
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


def _sleeps(pace: float, p: Params) -> Iterator[float]:
    """The code's sleeps between status reads (``poll_sleeps``), each at least ``poll_floor_ms``."""
    floor = p.poll_floor_ms * 1e-3
    for sleep in poll_sleeps(pace):
        yield math.ceil(sleep / floor - 1e-9) * floor if floor > 0 else sleep


def _poll_wait(waited: float, pace: float, p: Params) -> float:
    """Extra delay before a reader that waited ``waited`` s notices the relay is ready (its next poll); ``pace``:
    its waits so far, averaged as the code does (0: none)."""
    if waited <= 0:
        return 0.0
    t, lat, sleeps = 0.0, (p.latency_us + (p.status_us or p.bucket_us)) * 1e-6, _sleeps(pace, p)
    if pace:
        t = next(sleeps)
    while t < waited:
        t += lat
        if t >= waited:
            break
        t += next(sleeps)
    return t - waited


def _poll_duty(pace: float, p: Params) -> float:
    """The share of a core a waiting reader's poll loop takes: a status read per sleep (its first 8)."""
    sleeps = list(itertools.islice(_sleeps(pace, p), 8))
    status = (p.status_us or p.bucket_us) * 1e-6
    return status / (status + sum(sleeps) / len(sleeps)) if status > 0 else 0.0


def _rotate(seg: Segments, by: int) -> Segments:
    """The same segments, read starting at segment ``by`` (for readers that depend on nobody)."""
    keys = ("trainer", "relay", "need", "buckets", "relay_buckets", "reads", "nbytes", "tail")
    return dataclasses.replace(seg, **{k: np.roll(getattr(seg, k), -by, axis=0) for k in keys})


def simulate(cls: Classes, p: Params, *, registry_s: float, fetch_s: float, wire_bytes: int, engines: int,
             relay: bool, pending_s: float | None = None) -> Result:  # fmt: skip
    """``registry_s``: the registry's work on a version's records; ``pending_s``: on its records announced before
    their digests (what receivers that read early wait for; None: ``registry_s``)."""
    net, gb, rtt, lat = Net(), 1e9, p.registry_rtt_ms * 1e-3, p.latency_us * 1e-6
    verify_gbps, trainer_gbps = p.digest_gbps
    ups = upstreams(cls.plans, engines, relay)
    order = list(ups)
    rx: list[Rx] = []
    for k, (e, r) in enumerate(order):
        up = ups[(e, r)]
        pair = cls.pairs.get((r, up[1])) if up is not None else None
        seg = segments(cls.plans[r], pair, cls.plans[up[1]] if up is not None else None, len(cls.trainer_bytes),
                       p.segments)  # fmt: skip
        by = (e * len(seg.nbytes)) // max(1, engines) if p.rotate and not relay else 0
        rx.append(Rx(k, e, _rotate(seg, by)))
    for k, er in enumerate(order):
        up = ups[er]
        rx[k].up = rx[order.index(up)] if up is not None else None
    n, ntrain = len(rx), int(cls.trainer_gpu.max()) + 1
    t_eg = [net.resource(f"trainer {g} egress", p.gpu_gbps * gb if p.egress_limit else 0) for g in range(ntrain)]
    r_in = [net.resource(f"receiver {k} ingress", p.gpu_gbps * gb) for k in range(n)]
    r_out = [net.resource(f"receiver {k} egress", p.gpu_gbps * gb if p.egress_limit else 0) for k in range(n)]
    r_ver = [net.resource(f"receiver {k} verify", verify_gbps * gb) for k in range(n)]
    hpg = max(1, p.gpus_per_host)
    hosts = -(-ntrain // hpg) + -(-n // hpg)
    h_out = [net.resource(f"host {h} out", p.host_gbps * gb) for h in range(hosts)]
    h_in = [net.resource(f"host {h} in", p.host_gbps * gb) for h in range(hosts)]
    cpu = [net.resource(f"host {h} cpu", p.host_cores) for h in range(hosts)]
    switch, registry = net.resource("switch", p.switch_gbps * gb), net.resource("registry", p.registry_gbps * gb)
    t_host = [g // hpg for g in range(ntrain)]
    r_host = [-(-ntrain // hpg) + k // hpg for k in range(n)]
    egress = np.zeros(ntrain)
    complete = float(cls.trainer_bytes.max()) / (trainer_gbps * gb) + rtt + registry_s
    early = p.announce_early and not relay  # relays serve verified bytes: they wait for the digests
    digest_ready = complete + rtt / 2 + fetch_s if early else 0.0
    start_at = rtt + (registry_s if pending_s is None else pending_s) if early else complete
    host_verify = p.cpu_verify and not p.device_digests

    def phase_of(x: Rx) -> str:
        k, last = x.pulled + 1, len(x.seg.nbytes)
        if k >= last:
            return "verify of the last segment" if x.verified < last - 1 else "prepare, vote, commit"
        if x.posted < k:
            blocked = not x.posting and x.post_next == k and x.verified < k - 2
            return "verify (pull waits for it)" if blocked else "per-bucket and per-read costs"
        if k in x.waits:
            return "waiting for its relay"
        if k in x.relaying:
            return "relay reads"
        return "trainer reads" if x.tleft.get(k, 0) > 0 else "per-bucket and per-read costs"

    def mark(x: Rx, phase: str | None = None) -> None:
        phase = phase_of(x) if phase is None else phase
        if phase != x.phase:
            x.phases[x.phase] = x.phases.get(x.phase, 0.0) + net.now - x.since
            x.phase, x.since = phase, net.now

    def path(src_host: int, dst: int) -> list[tuple[int, float]]:
        uses = [(r_in[dst], 1.0)]
        if src_host != r_host[dst]:
            uses += [(h_out[src_host], 1.0), (h_in[r_host[dst]], 1.0), (switch, 1.0)]
        if p.cpu_copies:
            uses.append((cpu[r_host[dst]], 1.0 / (p.gpu_gbps * gb)))
        return uses

    def try_post(x: Rx) -> None:
        j, s = x.post_next, x.seg
        if x.posting or j >= len(s.nbytes) or x.verified < j - 2 or x.pulled < j - (1 if p.window <= 1 else 2):
            return
        x.posting, x.post_next = True, j + 1
        parts = {"per-bucket costs": s.buckets[j] * p.bucket_us, "relayed buckets": s.relay_buckets[j] *
                 p.relay_bucket_us, "descriptors": s.reads[j] * p.read_us}  # fmt: skip
        upkeep = p.cpu_ms + (p.relay_cpu_ms if relay else 0.0) + (p.reader_cpu_ms if x.up is not None else 0.0)
        if upkeep:  # spread over its segments, on its serial lane
            parts["upkeep"] = upkeep * 1e3 / len(s.nbytes)
        for k, v in parts.items():
            x.serial[k] = x.serial.get(k, 0.0) + v * 1e-6
        cost = sum(parts.values()) * 1e-6
        x.left[j] = 2  # the post itself (and its last bucket's round trip), and the transfer's start
        uses = ((cpu[r_host[x.i]], 1.0),) if p.host_cores and cost > 0 else ()
        if p.window <= 1:  # post, a round trip per bucket, then the bytes: one bucket in flight
            rounds = (s.buckets[j] + s.relay_buckets[j]) * lat
            net.start(Activity(cost, uses, lambda now: net.at(now + rounds, lambda t: posted(x, j, True)), cap=1.0))
        else:
            first = cost / max(1, int(s.buckets[j]))
            net.at(net.now + first + lat, lambda t: transfer(x, j))
            net.start(Activity(cost, uses, lambda now: posted(x, j, False), cap=1.0))
        mark(x)

    def posted(x: Rx, j: int, then_transfer: bool) -> None:
        x.posting, x.posted = False, j
        if then_transfer:
            transfer(x, j)
            part_done(x, j)
        else:
            net.at(net.now + lat, lambda t: part_done(x, j))
            try_post(x)
        mark(x)

    def transfer(x: Rx, j: int) -> None:
        """Segment j's bytes: the trainer's as one flow over every trainer GPU it reads (each GPU's egress and
        host NIC taken in proportion to its share: the sources advance together), the relay's as another."""
        gpus = np.bincount(cls.trainer_gpu, weights=x.seg.trainer[j], minlength=ntrain)
        todo = np.flatnonzero(gpus > 0)
        total, relayed = float(gpus.sum()), bool(x.seg.relay[j] > 0)
        x.left[j] += int(todo.size > 0) + int(relayed)
        x.tleft[j] = int(bool(todo.size))
        if todo.size:
            egress[todo] += gpus[todo]
            x.bytes_in += total
            uses: dict[int, float] = {}
            for g in todo.tolist():
                for res, w in [(t_eg[g], 1.0), *path(t_host[g], x.i)]:
                    uses[res] = uses.get(res, 0.0) + w * gpus[g] / total
            flow(x, "trainer", Activity(total, tuple(uses.items()), lambda now: trainer_done(x, j)))
        if relayed and (p.window > 1 or not todo.size):  # one bucket in flight: the relay's pieces after the trainer's
            relay_part(x, j)
        part_done(x, j)  # the transfer has started

    def flow(x: Rx, lane: str, act: Activity) -> None:
        """Start ``act`` once the receiver's earlier flows of ``lane`` are done: a peer serves a reader's reads in
        the order they were posted (a queue pair), so the window fills the link without delaying bucket j."""
        x.queue.setdefault(lane, deque()).append(act)
        if lane not in x.busy:
            next_flow(x, lane)

    def next_flow(x: Rx, lane: str) -> None:
        q = x.queue[lane]
        if q:
            x.busy.add(lane)
            net.start(q.popleft())
        else:
            x.busy.discard(lane)

    def trainer_done(x: Rx, j: int) -> None:
        next_flow(x, "trainer")
        x.tleft[j] = 0
        if p.window <= 1 and x.seg.relay[j] > 0:
            relay_part(x, j)
        part_done(x, j)

    def part_done(x: Rx, j: int) -> None:
        x.left[j] -= 1
        if x.left[j] == 0:
            del x.left[j]
            x.arrived.add(j)
            while x.pulled + 1 in x.arrived:
                x.arrived.remove(x.pulled + 1)
                x.pulled += 1
            try_verify(x)
            try_post(x)
        mark(x)

    def relay_part(x: Rx, j: int) -> None:
        up = x.up
        assert up is not None
        if up.verified >= x.seg.need[j]:
            relay_flow(x, j)
            return
        x.waits.add(j)
        up.waiting.append((x, j))
        x.waited_since[j] = net.now
        if p.host_cores and not p.relay_push and x.polling is None:  # the poll loop's status reads take CPU
            x.polling = Activity(1e18, ((cpu[r_host[x.i]], 1.0),), lambda now: None, cap=_poll_duty(x.pace, p))
            net.start(x.polling)
        mark(x)

    def relay_flow(x: Rx, j: int) -> None:
        up, b = x.up, float(x.seg.relay[j])
        assert up is not None
        x.waits.discard(j)
        if not x.waits and x.polling is not None:
            net.stop(x.polling)
            x.polling = None
        x.relaying.add(j)
        up.bytes_out += b
        x.bytes_in += b

        def done(now: float) -> None:
            next_flow(x, "relay")
            x.relaying.discard(j)
            part_done(x, j)

        flow(x, "relay", Activity(b, tuple([(r_out[up.i], 1.0), *path(r_host[up.i], x.i)]), done))
        mark(x)

    def try_verify(x: Rx) -> None:
        j = x.verified + 1
        if x.verifying >= j or j > x.pulled:
            return
        x.verifying = j
        uses = [(r_ver[x.i], 1.0)] + ([(cpu[r_host[x.i]], 1.0 / (verify_gbps * gb))] if host_verify else [])
        net.start(Activity(float(x.seg.nbytes[j]), tuple(uses), lambda t: hashed(x, j)))

    def hashed(x: Rx, j: int) -> None:
        """Hashed as it landed; a version announced before its digests holds each segment's hashes (pull goes
        on) and compares them once the digests are in: the last segment is verified no earlier than that."""
        if j == len(x.seg.nbytes) - 1 and net.now < digest_ready:
            net.at(digest_ready, lambda now: verified(x, j))
        else:
            verified(x, j)

    def verified(x: Rx, j: int) -> None:
        x.verified = j
        woken = [w for w in x.waiting if j >= w[0].seg.need[w[1]]]
        x.waiting = [w for w in x.waiting if w not in woken]
        for y, k in woken:
            waited = net.now - y.waited_since[k]
            delay = lat if p.relay_push else _poll_wait(waited, y.pace, p)
            y.pace = averaged(y.pace, waited + delay)
            net.at(net.now + delay, lambda now, y=y, k=k: relay_flow(y, k))
        if j < len(x.seg.nbytes) - 1:
            try_verify(x)
            try_post(x)
            mark(x)
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
        net.at(net.now + p.plan_s + (rtt if relay else 0.0), lambda now: start(x))

    def start(x: Rx) -> None:
        try_post(x)
        mark(x)

    def fetch(x: Rx) -> None:
        mark(x, "fetch, decode")
        net.start(Activity(float(wire_bytes), ((registry, 1.0),), lambda now: decode(x)))

    def decode(x: Rx) -> None:
        net.at(net.now + fetch_s, lambda t: found(x))

    for x in rx:
        net.at(start_at + rtt / 2, lambda now, x=x: fetch(x))
    net.run()
    for x in rx:
        net.now = x.committed
        mark(x, "")
    last = max(rx, key=lambda x: (x.committed, x.prepared))  # the engine's slowest rank, not one that waited
    worst = max(rx, key=lambda x: sum(x.serial.values()))
    bounds = {
        "trainer egress": float(egress.max()) / (p.gpu_gbps * gb),
        "receiver ingress": max(x.bytes_in for x in rx) / (p.gpu_gbps * gb),
        "relay egress": max(x.bytes_out for x in rx) / (p.gpu_gbps * gb),
        "verify": max(float(x.seg.nbytes.sum()) for x in rx) / (verify_gbps * gb),
        **{f"serial: {k}": v for k, v in worst.serial.items()},
        "registry NIC": wire_bytes * n / (p.registry_gbps * gb),
    }
    engine = sum(float(pl.bucket_bytes.sum()) for pl in cls.plans)
    phases = {k: v for k, v in last.phases.items() if k}
    slowest = max(x.prepared - x.found for x in rx)
    return Result(last.committed, slowest, float(egress.sum()), engine, max(x.bytes_out for x in rx), bounds, phases,
                  complete)  # fmt: skip
