"""Turn a layout table (local name → rule kind + canonical names) into one rank's layout map.

A table is data: ``{local suffix: (kind, (canonical suffixes...))}``. Kinds:

- ``rep``: the whole canonical tensor (replicated on every rank).
- ``col``: the canonicals' TP slices on axis 0, one after another (column-parallel, vocab-parallel,
  fused gate/up).
- ``row``: the canonical's TP slice on axis 1 (row-parallel ``o_proj``/``down_proj``).
- ``qkv_grouped``: Megatron's interleaved QKV: per query group of this rank, its query heads, one
  key head, one value head.
- ``qkv_flat``: vLLM's ``[q; k; v]`` of this rank's heads (kv heads replicated when TP > kv heads).
- ``experts_col`` / ``experts_row``: stacked experts (E, ·, ·): this EP rank's experts, the expert-TP
  slice of axis 1 (the canonicals one after another) / axis 2.
- ``expert_col`` / ``expert_row``: one expert's 2-D tensor (the local suffix holds ``{j}``, the
  local expert index), expert-TP sliced the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

from refitflow.core.errors import ConfigError
from refitflow.layouts.boxes import Box, full
from refitflow.layouts.canonical import LayoutMap, LocalTensor, ModelDims, canonical_shapes, concat

__all__ = ["Parallel", "Table", "build"]

Table = dict[str, tuple[str, tuple[str, ...]]]


@dataclass(frozen=True, kw_only=True)
class Parallel:
    """One rank's place: tensor parallel, expert parallel, and expert tensor parallel (default: tp)."""

    tp: int = 1
    tp_rank: int = 0
    ep: int = 1
    ep_rank: int = 0
    expert_tp: int | None = None

    def __post_init__(self) -> None:
        if not (0 <= self.tp_rank < self.tp and 0 <= self.ep_rank < self.ep):
            raise ConfigError(f"parallel ranks outside their sizes: {self}")
        if self.tp % self.etp:
            raise ConfigError("expert_tp must divide tp")

    @property
    def etp(self) -> int:
        return self.tp if self.expert_tp is None else self.expert_tp

    @property
    def etp_rank(self) -> int:
        return self.tp_rank % self.etp


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


def _rule(kind: str, names: tuple[str, ...], shapes: dict, d: ModelDims, par: Parallel, j: int) -> LocalTensor:
    if kind == "rep":
        return concat([(names[0], full(shapes[names[0]]))], shapes=shapes)
    if kind == "col":
        return concat(
            [(n, _with(full(shapes[n]), 0, _part(shapes[n][0], par.tp, par.tp_rank, n))) for n in names], shapes=shapes
        )
    if kind == "row":
        n = names[0]
        return concat([(n, _with(full(shapes[n]), 1, _part(shapes[n][1], par.tp, par.tp_rank, n)))], shapes=shapes)
    if kind.startswith("qkv"):
        return _qkv(kind, names, shapes, d, par)
    e0, e1 = _part(d.experts, par.ep, par.ep_rank, "experts")
    if kind.startswith("expert_"):
        e0, e1 = e0 + j, e0 + j + 1
    axis = 1 if kind.endswith("col") else 2
    parts = []
    for n in names:
        box = _with(full(shapes[n]), 0, (e0, e1))
        parts.append((n, _with(box, axis, _part(shapes[n][axis], par.etp, par.etp_rank, n))))
    if kind.startswith("expert_"):
        return concat(parts, axis=0, drop=1, shapes=shapes)
    return concat(parts, axis=1, shapes=shapes)


def build(top: Table, layer: Table, prefix: str, d: ModelDims, par: Parallel) -> LayoutMap:
    """One rank's layout map: ``top`` entries once, ``layer`` entries per layer under ``prefix.{i}.``.

    Entries whose canonical tensors the model lacks (no bias, tied head, dense vs MoE) are skipped.
    """
    shapes = canonical_shapes(d)
    out: LayoutMap = {}
    per_rank = d.experts // par.ep if d.experts else 0
    for local, (kind, names) in top.items():
        if all(n in shapes for n in names):
            out[local] = _rule(kind, names, shapes, d, par, 0)
    for i in range(d.layers):
        for suffix, (kind, names) in layer.items():
            full_names = tuple(f"model.layers.{i}.{n}" for n in names)
            if not all(n in shapes for n in full_names):
                continue
            for j in range(per_rank) if "{j}" in suffix else [0]:
                out[f"{prefix}.{i}.{suffix.format(j=j)}"] = _rule(kind, full_names, shapes, d, par, j)
    return out
