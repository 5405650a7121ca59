"""Plans of large MoE models (shape-only publications, meta tensors; issue 32, item 2):

- a receiver with a layout looks up only the trainer shards that meet what it reads (``stages._wanted``):
  its plan is the same, read for read, as one built from every shard;
- a shard whose direct pieces fit in one batch is not cut by a batch boundary (one read, not two);
- a slice that would fill more than ``max_direct_buckets`` batches gets larger batches;
- a new plan's checks are made on first use; a rank decodes the digests of the shards it reads only, and
  refuses a publication whose shards are not where the layout digest its plan was cached by says.
"""

from __future__ import annotations

import base64
import dataclasses
import gc
import itertools
import weakref

import numpy as np
import pytest
import torch
import xxhash

import refitflow as rf
from refitflow.core.digests import Tiling, choose_tiling
from refitflow.core.errors import ManifestError
from refitflow.layouts import ModelDims, Parallel, fused, megatron
from refitflow.layouts.wire import layout_metadata, resolve
from refitflow.planner import Plan, build_plan
from refitflow.planner import receiver_layout as _layout
from refitflow.planner.sources import meets
from refitflow.refit.config import ReceiverConfig
from refitflow.refit.destination import ApplyMode, Destination

DIMS = ModelDims(
    vocab=512,
    hidden=64,
    layers=3,
    heads=8,
    kv_heads=8,
    head_dim=16,
    ffn=128,
    dense_layers=1,
    experts=16,
    expert_ffn=256,
    shared_ffn=32,
    router_bias=True,
    q_lora_rank=48,
    kv_lora_rank=32,
    rope_dim=8,
    v_head_dim=16,
)  # fmt: skip  (Kimi-K2's family, small)
TRAIN = 4  # Megatron TP 4 x EP 4 folded, expert TP 1: rank r holds experts 4r..4r+3


def _spec(name: str, shape: tuple[int, ...]) -> rf.ShardSpec:
    rows, cols = choose_tiling(shape, 2)
    blocks = base64.b64encode(bytes(8 * Tiling("xxh3", shape, 2, rows, cols).count)).decode()
    return rf.ShardSpec(
        name=name, dtype="bfloat16", global_shape=shape, axis=None, start=0, stop=shape[0] if shape else 1,
        digest="0" * 16, region=0, tile_rows=rows, tile_cols=cols, blocks=blocks,
    )  # fmt: skip


def _publication(
    change: dict[str, tuple[int, ...]] | None = None, experts: str = "grouped", tp: int = TRAIN
) -> rf.Publication:
    ident = rf.Identity(model="moe", layout="megatron")
    manifests = []
    for r in range(TRAIN):
        par = Parallel(tp=tp, tp_rank=r % tp, ep=TRAIN, ep_rank=r, expert_tp=1)
        layout = megatron.layout(DIMS, par, experts=experts)
        shapes = {n: lt.shape for n, lt in layout.items()} | (change or {})
        manifests.append(rf.Manifest(
            identity=ident, version=1, rank=r, world_size=TRAIN, shards=tuple(_spec(n, s) for n, s in shapes.items()),
            source=rf.SourceAddress(transport="loopback", agent=f"t{r}"),
            metadata=layout_metadata("megatron", DIMS, par, experts=experts),
        ))  # fmt: skip
    return rf.Publication(identity=ident, version=1, manifests=tuple(manifests))


def _destination(rank: int) -> Destination:
    par = fused.parallel(tp=8, tp_rank=rank, dp=1, dp_rank=0, expert_parallel=True)
    layout = fused.layout(DIMS, par)
    params = {n: torch.empty(lt.shape, dtype=torch.bfloat16, device="meta") for n, lt in layout.items()}
    return Destination(params, ApplyMode.IN_PLACE, layout)


def _reads(plan: Plan) -> list[tuple[object, ...]]:
    pieces = [p for b in plan.buckets for p in b.pieces]
    return sorted((p.source, p.tensor, p.box, tuple((s.param, s.dbox) for s in p.scatters)) for p in pieces)


def _written(plan: Plan) -> list[tuple[str, object]]:
    return sorted((s.param, s.dbox) for b in plan.buckets for p in b.pieces for s in p.scatters)


@pytest.mark.parametrize(
    ("rank", "experts", "tp"),
    [(0, "grouped", TRAIN), (5, "grouped", TRAIN), (5, "sequential", TRAIN), (5, "grouped", 2)],
)
def test_a_plan_through_the_layout_index_reads_what_a_plan_from_every_shard_reads(
    rank: int, experts: str, tp: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    pub, dest, limits = _publication(experts=experts, tp=tp), _destination(rank), ReceiverConfig().limits
    indexed = build_plan(pub, dest, limits)
    assert _layout.ReceiverLayout(dest).wanted is not None  # a layout: the index is used
    monkeypatch.setattr(_layout, "Wanted", lambda layout: None)  # every shard, as before the index
    whole = build_plan(pub, dest, limits)
    if tp == TRAIN:
        assert _reads(indexed) == _reads(whole)
        assert indexed.digest_geometry == whole.digest_geometry
    else:  # each TP place has two replicas: which one a box is read from may differ (both balance the load:
        # through the index, within the place — every rank gives a share of what the places share)
        assert _written(indexed) == _written(whole)
        shared = {p.source for b in indexed.buckets for p in b.pieces if ".experts." not in p.tensor}
        assert shared == set(range(TRAIN))
        # an entry's boxes all from one replica: their widened regions merge (from two, each is read)
        assert indexed.nbytes <= whole.nbytes
    assert indexed.nbytes == whole.nbytes or tp != TRAIN
    assert indexed.ideal_bytes == whole.ideal_bytes
    experts = {p.tensor for b in indexed.buckets for p in b.pieces if ".experts." in p.tensor}
    assert experts and len(experts) < sum(".experts." in s.name for m in pub.manifests for s in m.shards)


def test_trainer_layouts_of_one_tp_place_share_their_entries_of_no_expert() -> None:
    """A trainer at TP 2 × EP 4: its 4 layouts are built on 2 shared parts (one per TP place), the entries
    read of each found once; the entries read of each layout are those of the whole layout that meet what the
    receiver reads, every name known."""
    wanted = _layout.ReceiverLayout(_destination(5)).wanted
    assert wanted is not None
    pars = [Parallel(tp=2, tp_rank=r % 2, ep=TRAIN, ep_rank=r, expert_tp=1) for r in range(TRAIN)]
    found = [wanted.resolved(layout_metadata("megatron", DIMS, p, experts="grouped")["layout"]) for p in pars]
    assert len(wanted._common) == 2
    for f, p in zip(found, pars, strict=True):
        whole = megatron.layout(DIMS, p, experts="grouped")
        assert f.names == frozenset(whole) and all(lt == whole[n] for n, _, lt in f.met)
        read = [(n, seg) for n, lt in whole.items() for seg in lt.segments
                if seg.canonical in wanted.boxes and meets(wanted.boxes[seg.canonical], seg.cbox)]  # fmt: skip
        met = {n for n, _, _ in f.met}
        assert any(".experts." in n for n in whole if n not in met)  # read in part
        assert len(f.met) == len(read) and {(n, seg) for n, seg, _ in f.met} == set(read)
    assert any(".experts." in n for f in found for n, _, _ in f.met)
    shared = [c.met for c in wanted._common.values()]
    assert len({id(m) for m in shared}) == 2 and all(shared)  # the entries read of each shared part, found once
    assert all(f.met[: len(m)] == m for f, m in zip(found, shared * 2, strict=True))
    assert len({id(f.names) for f in found}) == 1  # one name set: local names are the same at every place


def test_a_shard_that_does_not_fit_its_layout_is_refused_when_read() -> None:
    name = "decoder.layers.1.mlp.experts.linear_fc2.weight0"  # rank 0's first expert, read by receiver rank 0
    with pytest.raises(ManifestError, match="does not match its layout"):
        build_plan(_publication({name: (64, 16)}), _destination(0), ReceiverConfig().limits)
    ghost = {"decoder.layers.1.mlp.experts.linear_fc2.weight99": (64, 32)}  # a name its layout does not have
    with pytest.raises(ManifestError, match="does not match its layout"):
        build_plan(_publication(ghost), _destination(5), ReceiverConfig().limits)


def test_a_shard_that_fits_in_a_batch_is_not_cut_by_one() -> None:
    # an expert's fc1 is gate and up (two copies of one shard, two pieces): with batches of one fc1 and a
    # little, a batch that holds something else when an fc1 comes would end inside it were shards not kept whole
    pub, dest = _publication(), _destination(0)
    fc1 = 2 * DIMS.expert_ffn * DIMS.hidden * 2
    plan = build_plan(pub, dest, ReceiverConfig(direct_bucket_bytes=fc1 + 128).limits)
    where: dict[tuple[int, str], set[int]] = {}
    for b in plan.buckets:
        for p in b.pieces:
            if p.direct:
                where.setdefault((p.source, p.tensor), set()).add(b.index)
    assert any("linear_fc1" in t for _, t in where)
    assert all(len(buckets) == 1 for buckets in where.values()), where
    fc1_reads = [r for b in plan.buckets for r in b.reads if r.param and "w13" in r.param]
    fc1_shards = {k for k in where if "linear_fc1" in k[1] and ".experts." in k[1]}
    assert len(fc1_reads) == len(fc1_shards)  # gate and up: one read


def test_a_slice_that_would_fill_too_many_batches_gets_larger_ones() -> None:
    pub, dest = _publication(), _destination(0)
    many = build_plan(pub, dest, ReceiverConfig(direct_bucket_bytes=1024).limits)
    few = build_plan(pub, dest, ReceiverConfig(direct_bucket_bytes=1024, max_direct_buckets=8).limits)
    batch = -(-_layout.ReceiverLayout(dest).nbytes // 8)
    assert max(b.direct_bytes for b in many.buckets) <= 1024 < max(b.direct_bytes for b in few.buckets) <= batch
    assert len(few.buckets) < len(many.buckets) // 4
    assert _reads(many) != _reads(few) and many.nbytes == few.nbytes
    with pytest.raises(rf.ConfigError):
        ReceiverConfig(max_direct_buckets=0)


def test_a_trainer_layout_is_built_with_only_the_experts_a_receiver_reads() -> None:
    # receiver rank 5 of 8 (EP 8) holds experts 10 and 11: trainer rank 2's local experts 2 and 3
    wanted = _layout.ReceiverLayout(_destination(5)).wanted
    assert wanted is not None
    for r in range(TRAIN):
        text = layout_metadata("megatron", DIMS, Parallel(tp=TRAIN, tp_rank=r, ep=TRAIN, ep_rank=r, expert_tp=1),
                               experts="grouped")["layout"]  # fmt: skip
        whole = resolve(text)[0]
        found = wanted.resolved(text)
        assert found is wanted.resolved(text)  # kept with the receiver's Wanted
        assert found.names == set(whole)  # every name, built or left out
        assert all(lt == whole[n] for n, _, lt in found.met)
        experts = {n.rsplit(".", 1)[-1] for n, _, _ in found.met if ".experts." in n}
        assert experts == ({"weight2", "weight3"} if r == 2 else set()), (r, experts)
    hf_text = layout_metadata("hf_legacy", DIMS, Parallel())["layout"]  # HF checkpoint names: every expert, one rank
    found, whole = wanted.resolved(hf_text), resolve(hf_text)[0]
    assert found.names == set(whole) and all(lt == whole[n] for n, _, lt in found.met)
    assert {n.split(".experts.")[1].split(".")[0] for n, _, _ in found.met if ".experts." in n} == {"10", "11"}
    with pytest.raises(rf.ConfigError, match="not a layout option"):
        layout_metadata("megatron", DIMS, Parallel(), only=None)


def _digested(pub: rf.Publication) -> rf.Publication:
    """``pub`` with a distinct digest in every tile (the shape-only specs' are zeros)."""
    rng = np.random.default_rng(7)

    def spec(s: rf.ShardSpec) -> rf.ShardSpec:
        raw = rng.bytes(8 * s.tiling.count)
        return dataclasses.replace(s, blocks=base64.b64encode(raw).decode(), digest=xxhash.xxh3_64_hexdigest(raw))

    mans = tuple(dataclasses.replace(m, shards=tuple(map(spec, m.shards)), revision="") for m in pub.manifests)
    return dataclasses.replace(pub, manifests=mans)


def test_a_rank_decodes_the_digests_of_the_shards_it_reads_only() -> None:
    pub = _digested(_publication())
    plan = build_plan(pub, _destination(5), ReceiverConfig().limits)
    vec = plan.digests(pub)
    read = {(p.source, p.tensor) for b in plan.buckets for p in b.pieces}
    assert {(s, place[0]) for s, _, place in plan.digest_order} == read  # each shard read, once
    every = sum(s.tiling.count for m in pub.manifests for s in m.shards)
    assert vec.size == plan.digest_count < every // 2
    at = 0
    for s, p, place in plan.digest_order:  # each shard's digests where the plan's checks look for them
        spec = pub.manifests[s].shards[p]
        assert spec.name == place[0]
        want = np.frombuffer(spec.digest_bytes, dtype=">u8").astype(np.uint64)
        assert np.array_equal(vec[at : at + want.size], want)
        at += want.size
    assert at == vec.size


def test_a_new_plans_checks_are_made_on_first_use_its_digests_placed_at_once() -> None:
    """The first read waits for the plan, not for every bucket's checks (the plan stage makes them as it
    hands the buckets on); the digest vector's places are fixed by the plan, in plan order."""
    pub = _digested(_publication())
    plan = build_plan(pub, _destination(5), ReceiverConfig().limits)
    assert plan.digests(pub).size == plan.digest_count  # before any checks are made
    assert not any(b.is_built for b in plan.buckets)
    first = plan.buckets[0].checks
    assert plan.buckets[0].checks is first and plan.buckets[0].is_built  # made once
    assert not any(b.is_built for b in plan.buckets[1:])
    wants = [
        np.concatenate([ch.want, [s.want for s in ch.streams], *(m.want[m.check] for m in ch.mixes)])
        for ch in (b.checks for b in plan.buckets)
    ]  # fmt: skip
    assert np.concatenate(wants).max() < plan.digest_count  # every digest checked was placed by the plan
    assert all(a.max() <= b.max() for a, b in itertools.pairwise(wants))  # placed in plan order


def test_a_plan_lets_its_first_publications_manifests_go() -> None:
    """A cached plan outlives the version it was built for: its buckets' checks, made later, must not keep
    that version's manifests (every shard's digests: 880 MB for a ~3 T model) alive."""
    pub = _digested(_publication())
    plan = build_plan(pub, _destination(5), ReceiverConfig().limits)
    gone = [weakref.ref(m) for m in pub.manifests]
    del pub
    gc.collect()
    assert all(ref() is None for ref in gone)
    assert all(b.checks is not None for b in plan.buckets)  # made after: every shard was placed at plan time


def test_a_publication_whose_shards_moved_under_the_same_layout_digest_is_refused() -> None:
    """A plan is cached by the manifests' layout digests (the publisher's word): each version's shards are
    checked to be where, and what, they were when the plan placed their digests."""
    pub = _digested(_publication())
    plan = build_plan(pub, _destination(5), ReceiverConfig().limits)

    def with_shards(s: int, shards: tuple[rf.ShardSpec, ...]) -> rf.Publication:
        m = dataclasses.replace(
            pub.manifests[s], shards=shards, revision="", layout_digest=pub.manifests[s].layout_digest
        )
        return dataclasses.replace(pub, manifests=(*pub.manifests[:s], m, *pub.manifests[s + 1 :]))

    # a shard of one digest tile, read: it could be published as one whole-shard digest instead (as many digests)
    def one_tile(spec: rf.ShardSpec) -> bool:
        return spec.tiling.count == 1 and spec.tile_rows >= 2

    s, p, _ = next(o for o in plan.digest_order if one_tile(pub.manifests[o[0]].shards[o[1]]))
    shards = pub.manifests[s].shards
    spec = shards[p]
    rows = spec.tile_rows // 2
    raw = bytes(8 * Tiling(spec.algo, spec.tiling.shape, spec.tiling.item, rows, spec.tile_cols).count)
    halved = dataclasses.replace(spec, tile_rows=rows, blocks=base64.b64encode(raw).decode(),
                                 digest=xxhash.xxh3_64_hexdigest(raw))  # fmt: skip
    whole = dataclasses.replace(spec, tile_rows=0, tile_cols=0, blocks="")
    assert whole.tiling.count == 1 and halved.tiling.count > 1
    for bad in (
        with_shards(s, shards[::-1]),  # moved
        with_shards(s, shards[:p]),  # fewer shards: the ones read past the end are gone
        with_shards(s, (*shards[:p], halved, *shards[p + 1 :])),  # more digests
        with_shards(s, (*shards[:p], whole, *shards[p + 1 :])),  # as many, of another geometry
    ):
        with pytest.raises(ManifestError, match="not where, or not what, its layout digest says"):
            plan.digests(bad)
    assert plan.digests(pub).size == plan.digest_count  # the good one still decodes


@pytest.mark.parametrize("start", [0.25, 0.5, 0.9])
def test_a_plan_that_starts_later_in_its_slice_reads_the_same_from_its_first_shard_there(start: float) -> None:
    """``read_start``: the same pieces, read from the first shard that begins at ``start`` of the bytes or
    after and cuts no parameter (no parameter has pieces on both sides of the wrap), then round to the
    beginning; a shard's pieces stay together."""
    pub, dest = _publication(), _destination(0)
    config = dict(direct_bucket_bytes=64 << 10, bucket_bytes=32 << 10)
    plain = build_plan(pub, dest, ReceiverConfig(**config).limits)  # type: ignore[arg-type]
    later = build_plan(pub, dest, ReceiverConfig(read_start=start, **config).limits)  # type: ignore[arg-type]
    order = [p for b in plain.buckets for p in b.pieces]
    moved = [p for b in later.buckets for p in b.pieces]
    assert _reads(later) == _reads(plain) and later.nbytes == plain.nbytes and len(plain.buckets) > 8
    assert later.digest_count == plain.digest_count
    params = lambda ps: {sc.param for p in ps for sc in p.scatters}  # noqa: E731
    at, cut = 0, None
    for i, p in enumerate(order):
        if (at >= start * plain.nbytes and (p.source, p.tensor) != (order[i - 1].source, order[i - 1].tensor)
                and not params(order[:i]) & params(order[i:])):  # fmt: skip
            cut = i
            break
        at += p.nbytes
    assert cut is not None and 0 < cut < len(order)
    key = lambda p: (p.source, p.tensor, p.box)  # noqa: E731 (staged pieces' landing offsets differ by bucket)
    assert [key(p) for p in moved] == [key(p) for p in order[cut:] + order[:cut]]
    shards = [(p.source, p.tensor) for p in moved if p.direct]
    runs = [s for i, s in enumerate(shards) if i == 0 or s != shards[i - 1]]
    assert len(runs) == len(set(runs))  # each shard's direct pieces read one after another


def test_read_start_is_a_fraction_of_a_slice() -> None:
    for bad in (1, 1.0, -0.1, float("nan"), "0.5", True):
        with pytest.raises(rf.ConfigError, match="read_start"):
            ReceiverConfig(read_start=bad)  # type: ignore[arg-type]
    assert ReceiverConfig(read_start=0.5).limits.read_start == 0.5
