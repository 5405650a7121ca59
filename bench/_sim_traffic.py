"""Who reads what from whom, decided by refitflow's own code (for ``bench/simulate.py``).

- **Plans**: ``planner.build_plan`` on shape-only publications (``ShardSpec``s with the publisher's
  tile geometry and zero digests, as ``bench/kimi_plan_bench.py`` builds them) into meta tensors. A plan
  gives, per bucket, the bytes read from each trainer rank and the number of reads. Engines are replicas:
  rank ``r`` of every engine has the same plan, so each rank of one engine is planned once (a *class*)
  and reused by the other engines. Receivers that relay plan with their ``relay_bucket_bytes`` cap, the
  others with the default limits, as ``api.Receiver`` does.
- **Relays**: each class's offer is ``planner.fanout.held_boxes`` of its plan (checked by the registry's
  ``check_offer``); receivers join ``registry.service.fanout.Relays`` in join order and get their upstream
  from it; which of a reader's pieces its upstream holds, and which of the upstream's tensors each waits
  for, is ``planner.fanout.Geometry`` — the code a receiver runs.

What is simulated is the result reduced to *segments* (consecutive buckets, about ``1 / segments`` of a
rank's bytes each): bytes per trainer rank, bytes from the upstream relay and the upstream segment that
must be verified first, bucket and read counts.
"""

from __future__ import annotations

import hashlib
import pathlib
import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

import refitflow as rf
from refitflow.core.fanout import RelayOffer
from refitflow.planner import Plan, build_plan
from refitflow.planner.checks import used_digests
from refitflow.planner.fanout import Geometry, held_boxes
from refitflow.planner.limits import Limits
from refitflow.planner.routes import aux_owner
from refitflow.refit.config import ReceiverConfig
from refitflow.refit.destination import Destination
from refitflow.registry.service.fanout import Relays, check_offer

__all__ = ["Classes", "Pair", "RankPlan", "Setup", "limits_for", "plan_classes", "segments", "upstreams"]

MiB = 1 << 20


@dataclass(frozen=True)
class Setup:
    """A scenario: the trainer's publication, ``engines`` replicas of ``ranks`` receiver ranks each, and how
    to build rank ``r``'s landing (meta tensors and its layout)."""

    name: str
    pub: rf.Publication
    engines: int
    ranks: int
    landing: Callable[[int], Destination]
    trainer_gpu: Callable[[int], int] = lambda i: i  # manifest index → trainer GPU (replicated sources: same GPU)
    note: str = ""


@dataclass
class RankPlan:
    """One receiver class reduced: per piece its bucket, trainer source and bytes; per bucket its reads;
    per relay tensor the bucket that completes it; the plan itself (for relay geometries), dropped on save."""

    rank: int
    piece_bucket: np.ndarray
    piece_source: np.ndarray
    piece_bytes: np.ndarray
    bucket_reads: np.ndarray
    bucket_bytes: np.ndarray
    tensor_last: np.ndarray  # per relay param position: the last bucket writing it (-1: none)
    plan_seconds: float
    ideal_bytes: int
    digest_share: float  # the share of the publication's digests of the shards it reads
    part_digests: int = 0  # the digests its checks read: what it fetches per version (its plan's part)
    layout: str = ""  # relay layout digest ("" when it does not relay)
    converted: int = 0  # parameters routed "convert" (read in whole blocks, dequantised at commit), not copied
    offer: RelayOffer | None = None
    plan: Plan | None = field(default=None, repr=False)


@dataclass
class Pair:
    """What a reader class reads from an upstream class: per reader piece, relayed or not; per reader
    bucket, the upstream bucket that must be verified before its relayed pieces are served (-1: none)."""

    relayed: np.ndarray
    need: np.ndarray


@dataclass
class Classes:
    setup_name: str
    relay: bool
    plans: list[RankPlan]
    pairs: dict[tuple[int, int], Pair]
    model_bytes: int
    trainer_bytes: np.ndarray  # per manifest index: bytes it publishes
    trainer_gpu: np.ndarray  # per manifest index: the trainer GPU serving it
    specs: int  # shard specs in the publication (what the registry validates and every receiver decodes)
    digest_bytes: int  # base64 block digests in the publication (what every receiver fetched in format 4 alone)

    @property
    def digest_share(self) -> float:
        """The largest share of the publication's digests of the shards a rank reads."""
        return max(p.digest_share for p in self.plans)

    @property
    def part_digests(self) -> int:
        """The largest part a rank fetches per version (the digests its checks read)."""
        return max(p.part_digests for p in self.plans)


def limits_for(relay: bool, relay_bucket_bytes: int = 4 * MiB) -> Limits:
    """The limits ``api.Receiver`` plans with: the defaults, capped at ``relay_bucket_bytes`` for a relay."""
    lim = ReceiverConfig().limits
    if relay:
        lim = replace(lim, bucket_bytes=min(lim.bucket_bytes, relay_bucket_bytes),
                      direct_bucket_bytes=min(lim.direct_bucket_bytes, relay_bucket_bytes))  # fmt: skip
    return lim


def _reduce(rank: int, plan: Plan, dest: Destination, relay: bool, pub: rf.Publication, digests: int) -> RankPlan:
    pb, ps, pn, reads, bbytes = [], [], [], [], []
    for b in plan.buckets:
        for p in b.pieces:
            pb.append(b.index)
            ps.append(p.source)
            pn.append(p.nbytes)
        reads.append(sum(r.count if r.count > 1 else 1 for r in b.reads))
        bbytes.append(b.nbytes)
    target = plan.receiver
    assert target is not None
    last = np.full(len(target.relay_params), -1, dtype=np.int64)
    for b in plan.buckets:
        for p in b.pieces:
            for s in p.scatters:  # an auxiliary assembly (a converted parameter's blocks) completes its parameter
                last[target.position[aux_owner(s.param)]] = b.index
    offer, layout = None, ""
    if relay:
        held, layout = held_boxes(plan)
        offer = RelayOffer(identity=pub.identity, version=pub.version, receiver=f"class-{rank}",
                           source=rf.SourceAddress(transport="loopback", agent=f"receiver-{rank}"), status=0,
                           params=target.relay_params, held=held, layout=layout)  # fmt: skip
        check_offer(pub, offer)  # what the registry checks at relay_join
    for b in plan.buckets:  # every bucket's checks made, as after a receiver's first refit: its part
        b.built()
    part = used_digests(plan)
    return RankPlan(rank, np.array(pb, dtype=np.int64), np.array(ps, dtype=np.int64), np.array(pn, dtype=np.int64),
                    np.array(reads, dtype=np.int64), np.array(bbytes, dtype=np.int64), last, plan.seconds,
                    plan.ideal_bytes, plan.digest_count / digests, 0 if part is None else len(part), layout,
                    len(plan.route.converted), offer, plan)  # fmt: skip


def _pair(reader: RankPlan, up: RankPlan) -> Pair:
    assert reader.plan is not None and up.offer is not None
    geo = Geometry(reader.plan, up.offer)
    relayed = np.zeros(len(reader.piece_bytes), dtype=bool)
    need = np.full(len(reader.bucket_bytes), -1, dtype=np.int64)
    first = np.searchsorted(reader.piece_bucket, np.arange(len(reader.bucket_bytes)))
    for b, per in enumerate(geo.buckets):
        for k, rp in per.items():
            relayed[first[b] + k] = True
            need[b] = max(need[b], int(up.tensor_last[rp.params].max()))
    return Pair(relayed, need)


def plan_classes(
    setup: Setup, relay: bool, relay_bucket_bytes: int = 4 * MiB, cache: pathlib.Path | None = None,
    log: Callable[[str], None] = print,
) -> Classes:  # fmt: skip
    """Plan every rank of one engine with the real planner (and, relaying, pair every reader class with the
    upstream classes the scheduler can give it); cached on disk by scenario, limits and planner source."""
    path = None
    if cache is not None:
        mode = f"{'relay' if relay else 'pull'}-{relay_bucket_bytes}"
        path = cache / f"{setup.name}-{setup.engines}x{setup.ranks}-{mode}-{_source_hash()}.pkl"
        if path.exists():
            with path.open("rb") as f:
                return pickle.load(f)
    limits = limits_for(relay, relay_bucket_bytes)
    plans = []
    every = sum(s.tiling.count for m in setup.pub.manifests for s in m.shards)
    t0 = time.perf_counter()
    for r in range(setup.ranks):
        dest = setup.landing(r)
        plan = build_plan(setup.pub, dest, limits)
        plans.append(_reduce(r, plan, dest, relay, setup.pub, every))
        log(f"  planned {setup.name} rank {r:>2}: {len(plan.buckets):>6,} buckets, {plans[-1].bucket_reads.sum():>7,}"
            f" reads, {plan.nbytes / 1e9:7.2f} GB in {plan.seconds:5.2f} s")  # fmt: skip
    pairs: dict[tuple[int, int], Pair] = {}
    if relay:
        for reader, up in _possible_pairs(plans, setup.engines):
            pairs[(reader, up)] = _pair(plans[reader], plans[up])
        log(f"  relay geometries of {len(pairs)} (reader, upstream) class pairs: {time.perf_counter() - t0:.1f} s"
            " with the plans")  # fmt: skip
    sizes = np.array([sum(s.nbytes for s in m.shards) for m in setup.pub.manifests], dtype=np.int64)
    gpus = np.array([setup.trainer_gpu(i) for i in range(len(setup.pub.manifests))], dtype=np.int64)
    specs = sum(len(m.shards) for m in setup.pub.manifests)
    digests = sum(len(s.blocks) for m in setup.pub.manifests for s in m.shards)
    for p in plans:
        p.plan = None  # geometries are done: keep the reduction only
    out = Classes(setup.name, relay, plans, pairs, setup.pub.nbytes, sizes, gpus, specs, digests)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("wb") as f:
            pickle.dump(out, f)
    return out


def join_order(engines: int, ranks: int) -> list[tuple[int, int]]:
    """Receivers that start together join engine by engine, rank by rank (one order of many possible)."""
    return [(e, r) for e in range(engines) for r in range(ranks)]


def upstreams(plans: list[RankPlan], engines: int, relay: bool) -> dict[tuple[int, int], tuple[int, int] | None]:
    """Each receiver's upstream (engine, rank), or None for the trainer, from the registry's scheduler."""
    out: dict[tuple[int, int], tuple[int, int] | None] = {}
    if not relay:
        return {er: None for er in join_order(engines, len(plans))}
    relays = Relays()
    for e, r in join_order(engines, len(plans)):
        offer = plans[r].offer
        assert offer is not None
        up = relays.join(f"{e}/{r}", plans[r].layout, replace(offer, receiver=f"{e}/{r}"))
        out[(e, r)] = None if up is None else tuple(int(x) for x in up.receiver.split("/"))  # type: ignore[assignment]
    return out


def _possible_pairs(plans: list[RankPlan], engines: int) -> set[tuple[int, int]]:
    return {(r, up[1]) for (_, r), up in upstreams(plans, engines, True).items() if up is not None}


@dataclass
class Segments:
    """One receiver's work in order: per segment the bytes per trainer manifest index (dense), the bytes
    from its upstream, the upstream segment that must be verified first (-1: none), buckets, buckets with
    relayed pieces, reads, and the bytes of the segment's last bucket."""

    trainer: np.ndarray  # (segments, manifests)
    relay: np.ndarray
    need: np.ndarray
    buckets: np.ndarray
    relay_buckets: np.ndarray
    reads: np.ndarray
    nbytes: np.ndarray
    tail: np.ndarray
    bounds: np.ndarray  # the first bucket of each segment, and the bucket count at the end


def segments(rp: RankPlan, pair: Pair | None, up: RankPlan | None, manifests: int, count: int) -> Segments:
    """Cut ``rp``'s buckets into about ``count`` segments of equal bytes; relayed pieces per ``pair``."""
    nb = len(rp.bucket_bytes)
    bounds = _bounds(rp.bucket_bytes, count)
    n = len(bounds) - 1
    seg_of_bucket = np.searchsorted(bounds, np.arange(nb), side="right") - 1
    relayed = pair.relayed if pair is not None else np.zeros(len(rp.piece_bytes), dtype=bool)
    ps = seg_of_bucket[rp.piece_bucket]
    trainer = np.zeros((n, manifests))
    np.add.at(trainer, (ps[~relayed], rp.piece_source[~relayed]), rp.piece_bytes[~relayed])
    relay = np.bincount(ps[relayed], weights=rp.piece_bytes[relayed], minlength=n)
    need = np.full(n, -1, dtype=np.int64)
    rbuckets = np.zeros(n, dtype=np.int64)
    if pair is not None and up is not None:
        upb = _bounds(up.bucket_bytes, count)
        has = pair.need >= 0
        useg = np.where(has, np.searchsorted(upb, pair.need, side="right") - 1, -1)
        np.maximum.at(need, seg_of_bucket, useg)
        rbuckets = np.bincount(seg_of_bucket[has], minlength=n)
    buckets = np.diff(bounds)
    reads = np.add.reduceat(rp.bucket_reads, bounds[:-1]) if nb else np.zeros(0)
    nbytes = np.add.reduceat(rp.bucket_bytes, bounds[:-1]) if nb else np.zeros(0)
    tail = rp.bucket_bytes[bounds[1:] - 1] if nb else np.zeros(0)
    return Segments(trainer, relay, need, buckets, rbuckets, reads, nbytes.astype(float), tail.astype(float), bounds)


def _bounds(bucket_bytes: np.ndarray, count: int) -> np.ndarray:
    """The first bucket of each of about ``count`` segments of equal bytes, and the bucket count at the end."""
    nb = len(bucket_bytes)
    if nb == 0:
        return np.zeros(1, dtype=np.int64)
    cum = np.cumsum(bucket_bytes)
    want = np.linspace(0, cum[-1], min(count, nb) + 1)[1:-1]
    idx = np.clip(np.searchsorted(cum, want), 0, nb - 1)
    lower = np.clip(idx - 1, 0, nb - 1)
    nearer = np.where((idx > 0) & (want - cum[lower] < cum[idx] - want), lower, idx)  # the nearest bucket end
    cuts = nearer + 1
    return np.unique(np.concatenate([[0], cuts[(cuts > 0) & (cuts < nb)], [nb]]))


def _source_hash() -> str:
    """A digest of the planner's, layouts', the receiver's defaults (``ReceiverConfig``: the limits plans are made
    with) and this reduction's source: a cached reduction is stale when they change."""
    src = pathlib.Path(rf.__file__).parent
    h = hashlib.sha256()
    mine = pathlib.Path(__file__).resolve()
    ours = [*src.glob("planner/*.py"), *src.glob("layouts/*.py"), src / "registry/service/fanout.py",
            src / "refit/config.py"]  # fmt: skip
    for p in [*sorted(ours), mine, mine.with_name("_sim_quant.py")]:
        h.update(p.read_bytes())
    return h.hexdigest()[:12]
