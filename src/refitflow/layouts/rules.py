"""Turn layout tables (local name → rule kind + canonical names) into one rank's layout map.

A table is data: ``{local suffix: (kind, (canonical suffixes...))}``; what each kind makes of an entry is
``kinds.py``. An entry whose canonical tensors the model lacks (no bias, tied head, no shared experts) is
skipped.

A layout is a ``Tables``: the first pipeline stage's entries (embeddings), the last stage's (final
norm, LM head), and per-layer entries by part — every layer, the attention (grouped-query or latent),
the MLP (dense or experts) — chosen per layer from ``ModelDims``. A pipeline stage holds a range of
layers (``stages``: layers per stage), named by their global index or, Megatron's way, from 0 per stage.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from refitflow.core.errors import ConfigError
from refitflow.layouts.boxes import Box
from refitflow.layouts.canonical import LayoutMap, LocalTensor, ModelDims
from refitflow.layouts.kinds import (
    expert_range,
    pad,
    part,
    per_expert,
    rule,
    shapes_of,
    stage_range,
    suffixes,
    tp_rule,
    with_shapes,
)
from refitflow.layouts.parallel import Parallel

__all__ = ["Common", "Only", "Parallel", "Table", "Tables", "build", "expert_range", "pad", "shapes_of", "stage_range"]

Table = dict[str, tuple[str, tuple[str, ...]]]
_Recipe = tuple[str, str, str, tuple[str, ...]]  # an entry that depends on the EP rank: prefix, suffix, kind, names


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
    per_ep = (at + s for at, suffix in recipes for s in suffixes(suffix, local_experts if "{j}" in suffix else 1))
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
        part(d.heads, par.tp, par.tp_rank, "attention heads")
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
        out[local] = with_shapes(lt, shapes)
        slots.append(local)

    top = (tables.first if par.pp_rank == 0 else {}) | (tables.last if par.pp_rank == par.pp - 1 else {})
    for local, (kind, names) in top.items():
        if all(n in shapes for n in names):
            add(local, rule(kind, names, shapes, d, par, 0, rows))
    start, stop = stage_range(stages, d, par)
    for i in range(start, stop):
        at = f"{prefix}.{i - start if local_index else i}."
        for suffix, (kind, names) in tables.of_layer(d, i).items():
            full_names = tuple(f"model.layers.{i}.{n}" for n in names)
            if not all(n in shapes for n in full_names):
                continue
            if "{j}" not in suffix and not kind.startswith("expert"):
                add(at + suffix, tp_rule(kind, full_names, d, par.tp, par.tp_rank, rows))
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
        out[local] = with_shapes(lt, shapes)

    for at, suffix, kind, full_names in recipes:
        if "{j}" in suffix and kind.startswith("expert_"):  # one entry per expert: the boxes once per rank
            names = suffixes(suffix, e1 - e0)
            js = range(e1 - e0) if only is None else only.experts(full_names, e0, e1)
            for j, lt in zip(js, per_expert(kind, full_names, shapes, [(e0 + j, e0 + j + 1) for j in js], par),
                             strict=True):  # fmt: skip
                add(at + names[j], lt)
            continue
        for j in range(e1 - e0) if "{j}" in suffix else [0]:
            add(at + suffix.format(j=j), rule(kind, full_names, shapes, d, par, j, rows))
