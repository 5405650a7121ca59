"""What each rule kind of a layout table makes of an entry: the local tensor and its segments, for one rank.

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
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from functools import lru_cache

from refitflow.core.errors import ConfigError
from refitflow.layouts.boxes import Box, full
from refitflow.layouts.canonical import LocalTensor, ModelDims, Segment, canonical_shapes, concat
from refitflow.layouts.parallel import Parallel

__all__ = ["expert_range", "pad", "part", "per_expert", "rule", "shapes_of", "stage_range", "suffixes", "tp_rule",
           "with_shapes"]


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
        stages = (part(d.layers, par.pp, 0, "layers over pipeline stages")[1],) * par.pp
    if len(stages) != par.pp or sum(stages) != d.layers or min(stages) < 0:
        raise ConfigError(f"pipeline stages {list(stages)} do not split {d.layers} layers over {par.pp} stages")
    start = sum(stages[: par.pp_rank])
    return start, start + stages[par.pp_rank]


def part(n: int, parts: int, rank: int, what: str) -> tuple[int, int]:
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
        g0, g1 = part(d.kv_heads, par.tp, par.tp_rank, "kv heads (query groups)")
        parts = []
        for g in range(g0, g1):
            parts += [rows(q, g * qpg, qpg), rows(k, g, 1), rows(v, g, 1)]
        return concat(parts, shapes=shapes)
    h0, h1 = part(d.heads, par.tp, par.tp_rank, "attention heads")
    if par.tp >= d.kv_heads:
        part(par.tp, d.kv_heads, 0, "tp over kv heads")
        k0, kn = par.tp_rank // (par.tp // d.kv_heads), 1
    else:
        k0, k1 = part(d.kv_heads, par.tp, par.tp_rank, "kv heads")
        kn = k1 - k0
    return concat([rows(q, h0, h1 - h0), rows(k, k0, kn), rows(v, k0, kn)], shapes=shapes)


def _vocab(name: str, shape: tuple[int, ...], padded: int, par: Parallel) -> LocalTensor:
    """This rank's rows of the padded vocabulary; the real rows among them are mapped, the rest is padding."""
    lo, hi = part(padded, par.tp, par.tp_rank, f"padded vocabulary of {name}")
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
    return next(per_expert(kind, names, shapes, [(e0, e1)], par))


def per_expert(kind: str, names: tuple[str, ...], shapes: dict, spans: list[tuple[int, int]], par: Parallel
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
            part(shapes[n][1 if kind.endswith("col") else 2], par.etp, par.etp_rank, n)
        raise


@lru_cache(maxsize=256)
def suffixes(suffix: str, n: int) -> tuple[str, ...]:
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
        parts.append((str(k), _with(box, axis, part(shape[axis], etp, etp_rank, f"expert part {k}"))))
    lt = concat(parts, axis=0, drop=1) if kind.startswith("expert_") else concat(parts, axis=1)
    return lt.shape, tuple((g.cbox, g.lbox) for g in lt.segments)


@lru_cache(maxsize=16)
def shapes_of(d: ModelDims) -> dict[str, tuple[int, ...]]:
    """``canonical_shapes(d)``, shared by every layout of the model (read it, never change it)."""
    return canonical_shapes(d)


def with_shapes(lt: LocalTensor, shapes: dict[str, tuple[int, ...]]) -> LocalTensor:
    """Every segment knows its canonical tensor's whole shape: a publication of another shape is refused."""
    if any(g.shape is None for g in lt.segments):  # the rules' own segments have it already
        return LocalTensor(lt.shape, tuple(replace(g, shape=shapes[g.canonical]) for g in lt.segments))
    return lt


@lru_cache(maxsize=1 << 16)
def tp_rule(kind: str, names: tuple[str, ...], d: ModelDims, tp: int, tp_rank: int, rows: int) -> LocalTensor:
    """A rule of no experts: it depends on the TP place only, so it is built once for every EP and pipeline
    rank of a TP rank (a trainer at TP 8 × EP 32 has 4 ranks of each; replicated entries are every rank's)."""
    shapes = shapes_of(d)
    return with_shapes(rule(kind, names, shapes, d, Parallel(tp=tp, tp_rank=tp_rank), 0, rows), shapes)


def rule(
    kind: str, names: tuple[str, ...], shapes: dict, d: ModelDims, par: Parallel, j: int, vocab_rows: int
) -> LocalTensor:
    if kind == "rep":
        return concat([(n, full(shapes[n])) for n in names], shapes=shapes)
    if kind == "col":
        parts = [(n, _with(full(shapes[n]), 0, part(shapes[n][0], par.tp, par.tp_rank, n))) for n in names]
        return concat(parts, shapes=shapes)
    if kind == "row":
        n = names[0]
        return concat([(n, _with(full(shapes[n]), 1, part(shapes[n][1], par.tp, par.tp_rank, n)))], shapes=shapes)
    if kind == "vocab":
        return _vocab(names[0], shapes[names[0]], vocab_rows, par)
    if kind.startswith("qkv"):
        return _qkv(kind, names, shapes, d, par)
    if kind.startswith("expert"):
        return _experts(kind, names, shapes, d, par, j)
    raise ConfigError(f"unknown layout rule kind {kind!r}")


