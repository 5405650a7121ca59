"""Where among a tensor's replicas each rank starts (``planner.sources.place_of``): the ranks of one engine read
the same tensors in the same order; were ties among replicas broken alike in every plan, all of them would read
the same trainer rank at the same moment (DeepSeek-V3's TP 32 ranks, one of a stage's 16 EP ranks: its links
bound the refit). Rank r of n starts at replica r·k/n of k and goes round; and its plan starts at r / n of its
bytes (at a cut no parameter straddles), so the ranks of an engine read different pipeline stages of the trainer
at once."""

from __future__ import annotations

from collections.abc import Callable

import torch

import refitflow as rf
from refitflow.layouts.canonical import sliced
from refitflow.planner import build_plan
from refitflow.planner.receiver_layout import ReceiverLayout
from refitflow.planner.sources import held_in_place, place_of
from refitflow.refit.config import ReceiverConfig
from refitflow.refit.destination import ApplyMode, Destination

SHAPE = (64, 16)
TENSORS = [f"t{i}" for i in range(8)]
REPLICAS = 4


def _spec(name: str) -> rf.ShardSpec:
    return rf.ShardSpec(name=name, dtype="float32", global_shape=SHAPE, axis=None, start=0, stop=SHAPE[0],
                        digest="0" * 16, region=0)  # fmt: skip


def _publication(holds: Callable[[int], list[str]]) -> rf.Publication:
    """Trainer rank r of ``REPLICAS`` holding the tensors ``holds(r)``, each whole."""
    ident = rf.Identity(model="m")
    manifests = []
    for r in range(REPLICAS):
        source = rf.SourceAddress(transport="loopback", agent=f"a{r}")
        shards = tuple(map(_spec, holds(r)))
        manifests.append(rf.Manifest(identity=ident, version=1, rank=r, world_size=REPLICAS, shards=shards,
                                     source=source))  # fmt: skip
    return rf.Publication(identity=ident, version=1, manifests=tuple(manifests))


def _replicated() -> rf.Publication:
    """Every tensor held whole by each of ``REPLICAS`` trainer ranks."""
    return _publication(lambda r: TENSORS)


def _staged() -> rf.Publication:
    """A pipeline of ``REPLICAS`` stages: trainer rank s holds tensors 2s and 2s + 1."""
    return _publication(lambda s: TENSORS[2 * s : 2 * s + 2])


def _rank(r: int, n: int) -> Destination:
    """Rank ``r`` of a TP ``n`` engine: rows r/n of every tensor."""
    rows = SHAPE[0] // n
    layout = {t: sliced(t, SHAPE, 0, r * rows, (r + 1) * rows) for t in TENSORS}
    return Destination({t: torch.zeros(lt.shape) for t, lt in layout.items()}, ApplyMode.IN_PLACE, layout)


def _sources(dest: Destination) -> list[int]:
    """The trainer rank each tensor is read from, by tensor."""
    plan = build_plan(_replicated(), dest, ReceiverConfig().limits)
    by = {p.tensor: p.source for b in plan.buckets for p in b.pieces}
    return [by[t] for t in TENSORS]


def test_a_ranks_place_is_where_its_slice_lies_and_a_receiver_of_whole_tensors_is_at_0() -> None:
    assert [place_of(_rank(r, 8).layout or {}) for r in range(8)] == [r / 8 for r in range(8)]
    assert place_of({t: sliced(t, SHAPE) for t in TENSORS}) == 0.0
    assert ReceiverLayout(Destination({"t0": torch.zeros(SHAPE)}, ApplyMode.IN_PLACE)).place == 0.0
    # the largest tensor cut decides: a small one cut elsewhere does not
    layout = {"big": sliced("big", (64, 64), 1, 48, 64), "small": sliced("small", (8,), 0, 0, 4)}
    assert place_of(layout) == 0.75


def test_the_ranks_of_an_engine_read_each_tensor_from_different_replicas() -> None:
    n = REPLICAS
    reads = [_sources(_rank(r, n)) for r in range(n)]
    for r, sources in enumerate(reads):
        assert sources == [(r + t) % REPLICAS for t in range(len(TENSORS))]  # its place first, then round
    for step in zip(*reads, strict=True):
        assert sorted(step) == list(range(REPLICAS))  # never two ranks on one replica for one tensor
    # twice as many ranks as replicas: two on each, still every replica busy
    reads = [_sources(_rank(r, 2 * n)) for r in range(2 * n)]
    for step in zip(*reads, strict=True):
        assert sorted(step) == sorted(list(range(REPLICAS)) * 2)


def test_the_ranks_of_an_engine_read_different_stages_at_every_step() -> None:
    orders = []
    for r in range(REPLICAS):
        plan = build_plan(_staged(), _rank(r, REPLICAS), ReceiverConfig(bucket_bytes=1024).limits)
        pieces = [p for b in plan.buckets for p in b.pieces]
        orders.append([p.source for p in pieces])
        assert orders[-1][0] == r  # rank r of 4 starts at its place: r / 4 of its bytes, stage r
        seen: list[str] = []  # no parameter is cut by the wrap: each one's pieces are read one after another
        for p in pieces:
            for sc in p.scatters:
                assert sc.param not in seen[:-1] or seen[-1] == sc.param, sc.param
                if not seen or seen[-1] != sc.param:
                    seen.append(sc.param)
    for step in zip(*orders, strict=True):
        assert sorted(step) == list(range(REPLICAS))  # at every step each stage serves one rank
    # a read_start moves every rank on from its place
    plan = build_plan(_staged(), _rank(1, REPLICAS), ReceiverConfig(read_start=0.5).limits)
    assert next(p.source for b in plan.buckets for p in b.pieces) == 3


def test_the_entries_a_tp_place_shares_are_taken_from_its_ranks_starting_at_the_receivers_place() -> None:
    """``held_in_place``: each shared entry from the place's rank that gave the fewest bytes, ties from the
    receiver's place round."""
    local = {t: sliced(t, SHAPE) for t in TENSORS}
    shared = [(t, local[t].segments[0], local[t]) for t in TENSORS]
    specs = tuple(map(_spec, TENSORS))
    positions = {t: i for i, t in enumerate(TENSORS)}

    def taken(at: float) -> list[int]:
        got: dict[str, int] = {}
        sources = [(specs, positions, lambda spec, seg, k=k: got.setdefault(spec.name, k)) for k in range(3)]
        held_in_place(shared, sources, 1, at)
        return [got[t] for t in TENSORS]

    assert taken(0.0) == [t % 3 for t in range(len(TENSORS))]
    assert taken(0.5) == [(1 + t) % 3 for t in range(len(TENSORS))]
    assert taken(0.9) == [(2 + t) % 3 for t in range(len(TENSORS))]
