"""Turn layout tables (local name → rule kind + canonical names) into one rank's layout map.

A table is data: ``{local suffix: (kind, (canonical suffixes...))}``. An entry whose canonical
tensors the model lacks (no bias, tied head, no shared experts) is skipped. Kinds:

- ``rep``: the whole canonical tensor (replicated on every rank); several canonicals are laid one
  after another on axis 0 (vLLM's replicated ``fused_qkv_a_proj``).
- ``col``: the canonicals' TP slices on axis 0, one after another (column-parallel, fused gate/up).
- ``row``: the canonical's TP slice on axis 1 (row-parallel ``o_proj``/``down_proj``).
- ``vocab``: vocab-parallel rows of a *padded* vocabulary (embeddings, LM head): the local tensor is
  this rank's ``rows / tp`` of the padded size; only the rows below the real vocabulary are mapped,
  the padding rows are nobody's (never read, never written, not counted by coverage).
- ``qkv_grouped``: Megatron's interleaved QKV: per query group of this rank, its query heads, one
  key head, one value head.
- ``qkv_flat``: vLLM's ``[q; k; v]`` of this rank's heads (kv heads replicated when TP > kv heads).
- ``experts_col`` / ``experts_row``: stacked experts (E, ·, ·): this EP rank's experts, the expert-TP
  slice of axis 1 (the canonicals one after another) / axis 2.
- ``expert_col`` / ``expert_row``: one expert's 2-D tensor (the local suffix holds ``{j}``, the
  local expert index), expert-TP sliced the same way.

A layout is a ``Tables``: the first pipeline stage's entries (embeddings), the last stage's (final
norm, LM head), and per-layer entries by part — every layer, the attention (grouped-query or latent),
the MLP (dense or experts) — chosen per layer from ``ModelDims``. A pipeline stage holds a range of
layers (``stages``: layers per stage), named by their global index or, Megatron's way, from 0 per stage.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any

from refitflow.core.errors import ConfigError
from refitflow.layouts.boxes import Box, full
from refitflow.layouts.canonical import LayoutMap, LocalTensor, ModelDims, Segment, canonical_shapes, concat

__all__ = ["Common", "Only", "Parallel", "Table", "Tables", "build", "expert_range", "pad", "shapes_of", "stage_range"]

Table = dict[str, tuple[str, tuple[str, ...]]]
_Recipe = tuple[str, str, str, tuple[str, ...]]  # an entry that depends on the EP rank: prefix, suffix, kind, names


@dataclass(frozen=True, kw_only=True)
class Parallel:
    """One rank's place: tensor, expert, expert tensor (default: tp) and pipeline parallel.

    The expert-TP rank is ``tp_rank % expert_tp`` unless ``expert_tp_rank`` says otherwise (vLLM
    flattens the experts' TP over its data-parallel ranks, so there it can exceed ``tp``).
    """

    tp: int = 1
    tp_rank: int = 0
    ep: int = 1
    ep_rank: int = 0
    expert_tp: int | None = None
    expert_tp_rank: int | None = None
    pp: int = 1
    pp_rank: int = 0

    def __post_init__(self) -> None:
        if not (0 <= self.tp_rank < self.tp and 0 <= self.ep_rank < self.ep and 0 <= self.pp_rank < self.pp):
            raise ConfigError(f"parallel ranks outside their sizes: {self}")
        if self.expert_tp_rank is None and self.tp % self.etp:
            raise ConfigError("expert_tp must divide tp (or give expert_tp_rank)")
        if not 0 <= self.etp_rank < self.etp:
            raise ConfigError(f"expert_tp_rank outside expert_tp: {self}")

    @property
    def etp(self) -> int:
        return self.tp if self.expert_tp is None else self.expert_tp

    @property
    def etp_rank(self) -> int:
        return self.tp_rank % self.etp if self.expert_tp_rank is None else self.expert_tp_rank


@dataclass(frozen=True, kw_only=True)
class Tables:
    """A layout's tables: ``first``/``last`` on the first/last pipeline stage; per layer ``layer``, then its
    attention part, then its MLP part."""

    first: Table  # embeddings
    last: Table  # final norm, LM head
    layer: Table = field(default_factory=dict)  # every layer
    attention: Table = field(default_factory=dict)  # grouped-query / multi-head attention
    mla: Table = field(default_factory=dict)  # multi-head latent attention (DeepSeek-V2/V3, Kimi-K2)
    dense: Table = field(default_factory=dict)  # a dense MLP
    moe: Table = field(default_factory=dict)  # experts, router, shared experts

    def of_layer(self, d: ModelDims, i: int) -> Table:
        parts = (self.layer, self.mla if d.mla else self.attention, self.moe if d.moe_layer(i) else self.dense)
        merged = {k: v for part in parts for k, v in part.items()}
        if len(merged) < sum(map(len, parts)):
            raise ConfigError(f"two table entries make the same local name in layer {i}")
        return merged


@dataclass
class Common:
    """What the layouts of one TP and pipeline place share (a trainer at TP 8 × EP 32 has 4 ranks of each):
    the entries of no expert, in order, and the recipes of those that depend on the EP rank — built once
    per receiver (``Only.common``). ``met``: the planner's list of the entries its receiver reads, kept with
    them. The set of local names is shared by places further (``_local_names``): a TP 8 × EP 8 trainer's 8
    ranks have one."""

    entries: dict[str, LocalTensor]
    # in table order, each entry's name or the recipe (prefix, suffix, kind, canonical names) of those that
    # depend on the EP rank
    slots: list[str | _Recipe]
    per_ep: list[_Recipe]  # the recipes alone
    met: Any = None
    names: dict[int, frozenset[str]] = field(default_factory=dict)  # by local experts: ``local_names``

    def local_names(self, local_experts: int) -> frozenset[str]:
        """Every local name of a layout of this place with ``local_experts`` experts (those of the entries one
        per expert are local indexes: the same on every EP rank; names are the same on every TP rank too, so
        places share them: ``_local_names``)."""
        found = self.names.get(local_experts)
        if found is None:
            recipes = tuple((at, suffix) for at, suffix, _, _ in self.per_ep)
            found = self.names[local_experts] = _local_names(tuple(self.entries), recipes, local_experts)
        return found


@lru_cache(maxsize=64)
def _local_names(entries: tuple[str, ...], recipes: tuple[tuple[str, str], ...], local_experts: int) -> frozenset[str]:
    """``entries`` and the names ``recipes`` make for ``local_experts`` experts (a ~3 T trainer rank: 17,280)."""
    per_ep = (at + s for at, suffix in recipes for s in _suffixes(suffix, local_experts if "{j}" in suffix else 1))
    return frozenset(entries).union(per_ep)


@dataclass(frozen=True)
class Only:
    """A layout built in part: of the entries one per expert (Megatron's ``...{j}...``), only those of the
    experts that ``wanted`` (canonical name -> the boxes read of it; None: all of it; absent: none of it)
    reads. A receiver at EP 16 reads 1/16 of a trainer rank's per-expert entries (138,000 on a ~3 T model):
    planning builds only those.

    ``common``: the parts shared by layouts of one TP and pipeline place (``Common``, by place: pass one
    dict to every ``Only`` of a receiver); ``used`` gets the one this layout was built on, ``extra`` its
    entries beyond it, ``names`` every local name of the layout (those left out too)."""

    wanted: Mapping[str, tuple[Box, ...] | None]
    common: dict[tuple[object, ...], Common] = field(default_factory=dict)
    used: list[Common] = field(default_factory=list)
    extra: dict[str, LocalTensor] = field(default_factory=dict)
    names: list[frozenset[str]] = field(default_factory=list)

    def experts(self, names: tuple[str, ...], e0: int, e1: int) -> list[int]:
        """The local indexes of experts ``[e0, e1)`` whose rows of ``names`` are read (along the expert axis)."""
        kept: set[int] = set()
        for name in names:
            boxes = self.wanted.get(name, ())
            if boxes is None or any(not b for b in boxes):
                return list(range(e1 - e0))
            for (lo, hi), *_ in boxes:
                kept.update(range(max(lo, e0) - e0, min(hi, e1) - e0))
        return sorted(kept)


def pad(n: int, multiple: int) -> int:
    """``n`` rounded up to a multiple of ``multiple``."""
    if multiple < 1:
        raise ConfigError(f"a padding multiple must be at least 1, not {multiple}")
    return -(-n // multiple) * multiple


def expert_range(experts: int, ep: int, rank: int) -> tuple[int, int]:
    """This EP rank's experts ``[start, stop)``: contiguous, the first ``experts % ep`` ranks one more.

    vLLM's ``linear`` placement; Megatron's (which requires ``ep`` to divide ``experts``) when even.
    """
    base, extra = divmod(experts, ep)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def stage_range(stages: tuple[int, ...] | None, d: ModelDims, par: Parallel) -> tuple[int, int]:
    """The layers ``[start, stop)`` of this rank's pipeline stage (``stages``: layers per stage; None: even)."""
    if stages is None:
        stages = (_part(d.layers, par.pp, 0, "layers over pipeline stages")[1],) * par.pp
    if len(stages) != par.pp or sum(stages) != d.layers or min(stages) < 0:
        raise ConfigError(f"pipeline stages {list(stages)} do not split {d.layers} layers over {par.pp} stages")
    start = sum(stages[: par.pp_rank])
    return start, start + stages[par.pp_rank]


def _part(n: int, parts: int, rank: int, what: str) -> tuple[int, int]:
    if n % parts:
        raise ConfigError(f"{what} ({n}) is not divisible by {parts}")
    k = n // parts
    return rank * k, (rank + 1) * k


def _with(box: Box, axis: int, rng: tuple[int, int]) -> Box:
    b = list(box)
    b[axis] = rng
    return tuple(b)


def _qkv(kind: str, names: tuple[str, ...], shapes: dict, d: ModelDims, par: Parallel) -> LocalTensor:
    q, k, v = names
    hd, tail = d.head_dim, full(shapes[q])[1:]
    qpg = d.heads // d.kv_heads

    def rows(name: str, first: int, count: int) -> tuple[str, Box]:
        return name, ((first * hd, (first + count) * hd), *tail)

    if kind == "qkv_grouped":
        g0, g1 = _part(d.kv_heads, par.tp, par.tp_rank, "kv heads (query groups)")
        parts = []
        for g in range(g0, g1):
            parts += [rows(q, g * qpg, qpg), rows(k, g, 1), rows(v, g, 1)]
        return concat(parts, shapes=shapes)
    h0, h1 = _part(d.heads, par.tp, par.tp_rank, "attention heads")
    if par.tp >= d.kv_heads:
        _part(par.tp, d.kv_heads, 0, "tp over kv heads")
        k0, kn = par.tp_rank // (par.tp // d.kv_heads), 1
    else:
        k0, k1 = _part(d.kv_heads, par.tp, par.tp_rank, "kv heads")
        kn = k1 - k0
    return concat([rows(q, h0, h1 - h0), rows(k, k0, kn), rows(v, k0, kn)], shapes=shapes)


def _vocab(name: str, shape: tuple[int, ...], padded: int, par: Parallel) -> LocalTensor:
    """This rank's rows of the padded vocabulary; the real rows among them are mapped, the rest is padding."""
    lo, hi = _part(padded, par.tp, par.tp_rank, f"padded vocabulary of {name}")
    real = min(hi, shape[0]) - lo
    local = (hi - lo, *shape[1:])
    if real <= 0:  # all padding (a small vocabulary over many ranks)
        return LocalTensor(local, ())
    cbox = _with(full(shape), 0, (lo, lo + real))
    return LocalTensor(local, (Segment(name, cbox, _with(full(local), 0, (0, real)), shape),))


def _experts(kind: str, names: tuple[str, ...], shapes: dict, d: ModelDims, par: Parallel, j: int) -> LocalTensor:
    e0, e1 = expert_range(d.experts, par.ep, par.ep_rank)
    if kind.startswith("expert_"):
        e0, e1 = e0 + j, e0 + j + 1
    return next(_per_expert(kind, names, shapes, [(e0, e1)], par))


def _per_expert(kind: str, names: tuple[str, ...], shapes: dict, spans: list[tuple[int, int]], par: Parallel
                ) -> Iterator[LocalTensor]:  # fmt: skip
    """A local tensor for each range of experts in ``spans`` (one expert each for a per-expert kind)."""
    whole = tuple(tuple(shapes[n]) for n in names)
    try:
        for lo, hi in spans:
            local, boxes = _expert_boxes(kind, whole, lo, hi, par.etp, par.etp_rank)
            segments = tuple(Segment(n, c, b, s) for n, (c, b), s in zip(names, boxes, whole, strict=True))
            yield LocalTensor(local, segments)
    except ConfigError:  # name the tensor whose experts do not split
        for n in names:
            _part(shapes[n][1 if kind.endswith("col") else 2], par.etp, par.etp_rank, n)
        raise


@lru_cache(maxsize=256)
def _suffixes(suffix: str, n: int) -> tuple[str, ...]:
    """``suffix`` for local experts 0..n-1 (the same in every layer)."""
    return tuple(suffix.format(j=j) for j in range(n))


@lru_cache(maxsize=1 << 12)
def _expert_boxes(kind: str, shapes: tuple[tuple[int, ...], ...], e0: int, e1: int, etp: int, etp_rank: int
                  ) -> tuple[tuple[int, ...], tuple[tuple[Box, Box], ...]]:  # fmt: skip
    """The local shape and (canonical box, local box) per part of experts ``[e0, e1)``: the same for every
    layer of a model (a trillion-parameter trainer rank has 138,000 per-expert entries)."""
    axis = 1 if kind.endswith("col") else 2
    parts = []
    for k, shape in enumerate(shapes):
        box = _with(full(shape), 0, (e0, e1))
        parts.append((str(k), _with(box, axis, _part(shape[axis], etp, etp_rank, f"expert part {k}"))))
    lt = concat(parts, axis=0, drop=1) if kind.startswith("expert_") else concat(parts, axis=1)
    return lt.shape, tuple((g.cbox, g.lbox) for g in lt.segments)


@lru_cache(maxsize=16)
def shapes_of(d: ModelDims) -> dict[str, tuple[int, ...]]:
    """``canonical_shapes(d)``, shared by every layout of the model (read it, never change it)."""
    return canonical_shapes(d)


def _with_shapes(lt: LocalTensor, shapes: dict[str, tuple[int, ...]]) -> LocalTensor:
    """Every segment knows its canonical tensor's whole shape: a publication of another shape is refused."""
    if any(g.shape is None for g in lt.segments):  # the rules' own segments have it already
        return LocalTensor(lt.shape, tuple(replace(g, shape=shapes[g.canonical]) for g in lt.segments))
    return lt


@lru_cache(maxsize=1 << 16)
def _tp_rule(kind: str, names: tuple[str, ...], d: ModelDims, tp: int, tp_rank: int, rows: int) -> LocalTensor:
    """A rule of no experts: it depends on the TP place only, so it is built once for every EP and pipeline
    rank of a TP rank (a trainer at TP 8 × EP 32 has 4 ranks of each; replicated entries are every rank's)."""
    shapes = shapes_of(d)
    return _with_shapes(_rule(kind, names, shapes, d, Parallel(tp=tp, tp_rank=tp_rank), 0, rows), shapes)


def _rule(
    kind: str, names: tuple[str, ...], shapes: dict, d: ModelDims, par: Parallel, j: int, vocab_rows: int
) -> LocalTensor:
    if kind == "rep":
        return concat([(n, full(shapes[n])) for n in names], shapes=shapes)
    if kind == "col":
        parts = [(n, _with(full(shapes[n]), 0, _part(shapes[n][0], par.tp, par.tp_rank, n))) for n in names]
        return concat(parts, shapes=shapes)
    if kind == "row":
        n = names[0]
        return concat([(n, _with(full(shapes[n]), 1, _part(shapes[n][1], par.tp, par.tp_rank, n)))], shapes=shapes)
    if kind == "vocab":
        return _vocab(names[0], shapes[names[0]], vocab_rows, par)
    if kind.startswith("qkv"):
        return _qkv(kind, names, shapes, d, par)
    if kind.startswith("expert"):
        return _experts(kind, names, shapes, d, par, j)
    raise ConfigError(f"unknown layout rule kind {kind!r}")


def build(
    tables: Tables,
    prefix: str,
    d: ModelDims,
    par: Parallel,
    *,
    vocab_rows: int | None = None,
    stages: tuple[int, ...] | None = None,
    local_index: bool = False,
    only: Only | None = None,
) -> LayoutMap:
    """One rank's layout map: ``tables.first``/``last`` on the first/last stage, each of the stage's
    layers under ``prefix.{i}.`` (``i`` global, or counted from the stage's first layer: ``local_index``).

    ``vocab_rows``: the padded vocabulary the ``vocab`` entries are split from (default: no padding).
    ``stages``: layers per pipeline stage (default: an even split).
    ``only``: build the entries one per expert in part (``Only``).
    """
    rows = d.vocab if vocab_rows is None else vocab_rows
    if rows < d.vocab:
        raise ConfigError(f"the padded vocabulary ({rows}) is smaller than the vocabulary ({d.vocab})")
    if d.mla:  # latent attention splits whole heads over TP (q_b_proj, kv_b_proj, o_proj)
        _part(d.heads, par.tp, par.tp_rank, "attention heads")
    if only is None:  # in table order
        common = _common(tables, prefix, d, par, rows, stages, local_index)
        out: LayoutMap = {}
        for slot in common.slots:
            if isinstance(slot, str):
                out[slot] = common.entries[slot]
            else:
                _per_ep(out, [slot], common.entries, d, par, rows, None)
        return out
    key = (_tables_key(tables), prefix, d, par.tp, par.tp_rank, par.pp, par.pp_rank, rows, stages, local_index)
    found = only.common.get(key)
    if found is None:
        found = only.common[key] = _common(tables, prefix, d, par, rows, stages, local_index)
    common = found
    only.used.append(common)
    _per_ep(only.extra, common.per_ep, common.entries, d, par, rows, only)
    e0, e1 = expert_range(d.experts, par.ep, par.ep_rank)
    only.names.append(common.local_names(e1 - e0))
    return common.entries | only.extra


def _tables_key(tables: Tables) -> tuple[object, ...]:
    parts = (tables.first, tables.last, tables.layer, tables.attention, tables.mla, tables.dense, tables.moe)
    return tuple(tuple(part.items()) for part in parts)


def _common(tables: Tables, prefix: str, d: ModelDims, par: Parallel, rows: int, stages: tuple[int, ...] | None,
            local_index: bool) -> Common:  # fmt: skip
    """The entries of no expert (they depend on the TP and pipeline place only), and the others' recipes."""
    shapes = shapes_of(d)
    out: LayoutMap = {}
    slots: list[str | _Recipe] = []

    def add(local: str, lt: LocalTensor) -> None:
        if local in out:
            raise ConfigError(f"two table entries make the local tensor {local!r}")
        out[local] = _with_shapes(lt, shapes)
        slots.append(local)

    top = (tables.first if par.pp_rank == 0 else {}) | (tables.last if par.pp_rank == par.pp - 1 else {})
    for local, (kind, names) in top.items():
        if all(n in shapes for n in names):
            add(local, _rule(kind, names, shapes, d, par, 0, rows))
    start, stop = stage_range(stages, d, par)
    for i in range(start, stop):
        at = f"{prefix}.{i - start if local_index else i}."
        for suffix, (kind, names) in tables.of_layer(d, i).items():
            full_names = tuple(f"model.layers.{i}.{n}" for n in names)
            if not all(n in shapes for n in full_names):
                continue
            if "{j}" not in suffix and not kind.startswith("expert"):
                add(at + suffix, _tp_rule(kind, full_names, d, par.tp, par.tp_rank, rows))
            else:
                slots.append((at, suffix, kind, full_names))
    return Common(out, slots, [s for s in slots if not isinstance(s, str)])


def _per_ep(out: LayoutMap, recipes: list[_Recipe], common: Mapping[str, LocalTensor], d: ModelDims, par: Parallel,
            rows: int, only: Only | None) -> None:  # fmt: skip
    """The entries of ``recipes`` (they depend on the EP rank) into ``out``: one per expert (of those ``only``
    reads), or stacked; a name already in ``out`` or ``common`` is a ``ConfigError``."""
    shapes = shapes_of(d)
    e0, e1 = expert_range(d.experts, par.ep, par.ep_rank)

    def add(local: str, lt: LocalTensor) -> None:
        if local in out or local in common:
            raise ConfigError(f"two table entries make the local tensor {local!r}")
        out[local] = _with_shapes(lt, shapes)

    for at, suffix, kind, full_names in recipes:
        if "{j}" in suffix and kind.startswith("expert_"):  # one entry per expert: the boxes once per rank
            suffixes = _suffixes(suffix, e1 - e0)
            js = range(e1 - e0) if only is None else only.experts(full_names, e0, e1)
            for j, lt in zip(js, _per_expert(kind, full_names, shapes, [(e0 + j, e0 + j + 1) for j in js], par),
                             strict=True):  # fmt: skip
                add(at + suffixes[j], lt)
            continue
        for j in range(e1 - e0) if "{j}" in suffix else [0]:
            add(at + suffix.format(j=j), _rule(kind, full_names, shapes, d, par, j, rows))
