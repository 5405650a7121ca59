"""Canonical space: the unfused, unsharded tensors every layout maps its local parameters onto.

Canonical names are the HF names of an unfused model (``q_proj``, ``gate_proj``, ...), with the MoE
experts as stacked 3-D tensors ``mlp.experts.{gate,up}`` (E, F, H) and ``mlp.experts.down`` (E, H, F).
A *layout map* says, for each local parameter of one rank, its shape and the boxes of canonical
tensors it holds (``Segment``). Everything else (plans, reassembly) is box algebra on these maps.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass

import torch

from refitflow.core.errors import ConfigError
from refitflow.layouts.boxes import Box, full, shape_of

__all__ = [
    "LayoutMap",
    "LocalTensor",
    "ModelDims",
    "Segment",
    "canonical_shapes",
    "concat",
    "from_canonical",
    "sliced",
    "to_canonical",
]


@dataclass(frozen=True, kw_only=True)
class ModelDims:
    """The model dimensions a layout table needs (a decoder-only transformer, dense or MoE)."""

    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int = 0  # dense MLP width (0: MoE)
    experts: int = 0
    expert_ffn: int = 0
    qkv_bias: bool = False
    qk_norm: bool = False
    tied: bool = False

    def __post_init__(self) -> None:
        if self.heads % self.kv_heads:
            raise ConfigError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if bool(self.ffn) == bool(self.experts):
            raise ConfigError("a model has either a dense MLP (ffn) or experts (experts, expert_ffn)")

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> ModelDims:
        return cls(**json.loads(text))


@dataclass(frozen=True, slots=True)
class Segment:
    """``canonical[cbox]`` is held at ``local[lbox]`` (same extents; cbox may add leading size-1 dims).

    ``shape``: the whole canonical tensor's shape, when the layout knows it (tables always do): a
    publication of another shape is refused instead of read in part.
    """

    canonical: str
    cbox: Box
    lbox: Box
    shape: tuple[int, ...] | None = None


@dataclass(frozen=True, slots=True)
class LocalTensor:
    shape: tuple[int, ...]
    segments: tuple[Segment, ...]


LayoutMap = dict[str, LocalTensor]


def canonical_shapes(d: ModelDims) -> dict[str, tuple[int, ...]]:
    """Every canonical tensor of the model and its shape."""
    q, kv = d.heads * d.head_dim, d.kv_heads * d.head_dim
    out: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (d.vocab, d.hidden),
        "model.norm.weight": (d.hidden,),
    }
    if not d.tied:
        out["lm_head.weight"] = (d.vocab, d.hidden)
    for i in range(d.layers):
        p = f"model.layers.{i}."
        out |= {
            p + "input_layernorm.weight": (d.hidden,),
            p + "post_attention_layernorm.weight": (d.hidden,),
            p + "self_attn.q_proj.weight": (q, d.hidden),
            p + "self_attn.k_proj.weight": (kv, d.hidden),
            p + "self_attn.v_proj.weight": (kv, d.hidden),
            p + "self_attn.o_proj.weight": (d.hidden, q),
        }
        if d.qkv_bias:
            out |= {
                p + "self_attn.q_proj.bias": (q,),
                p + "self_attn.k_proj.bias": (kv,),
                p + "self_attn.v_proj.bias": (kv,),
            }
        if d.qk_norm:
            out |= {p + "self_attn.q_norm.weight": (d.head_dim,), p + "self_attn.k_norm.weight": (d.head_dim,)}
        if d.ffn:
            out |= {
                p + "mlp.gate_proj.weight": (d.ffn, d.hidden),
                p + "mlp.up_proj.weight": (d.ffn, d.hidden),
                p + "mlp.down_proj.weight": (d.hidden, d.ffn),
            }
        else:
            e, f = d.experts, d.expert_ffn
            out |= {
                p + "mlp.gate.weight": (e, d.hidden),
                p + "mlp.experts.gate": (e, f, d.hidden),
                p + "mlp.experts.up": (e, f, d.hidden),
                p + "mlp.experts.down": (e, d.hidden, f),
            }
    return out


def sliced(
    canonical: str, global_shape: tuple[int, ...], axis: int | None = None, start: int = 0, stop: int = 0
) -> LocalTensor:
    """The trivial layout: a local tensor is ``canonical[start:stop]`` along ``axis`` (None: all of it)."""
    box = list(full(global_shape))
    if axis is not None:
        box[axis] = (start, stop)
    b = tuple(box)
    return LocalTensor(shape_of(b), (Segment(canonical, b, full(shape_of(b)), tuple(global_shape)),))


def concat(
    parts: list[tuple[str, Box]], axis: int = 0, drop: int = 0, shapes: Mapping[str, tuple[int, ...]] | None = None
) -> LocalTensor:
    """A local tensor made of canonical boxes laid one after another along ``axis``.

    ``drop``: leading size-1 dimensions of the canonical boxes the local tensor does not have;
    ``shapes``: the canonical tensors' whole shapes (recorded in each segment).
    """
    segments, pos = [], 0
    shape: list[int] = []
    for name, cbox in parts:
        ext = list(shape_of(cbox)[drop:])
        lbox = list(full(ext))
        lbox[axis] = (pos, pos + ext[axis])
        pos += ext[axis]
        segments.append(Segment(name, cbox, tuple(lbox), None if shapes is None else tuple(shapes[name])))
        shape = ext
    shape[axis] = pos
    return LocalTensor(tuple(shape), tuple(segments))


def _index(box: Box) -> tuple[slice, ...]:
    return tuple(slice(s, e) for s, e in box)


def to_canonical(
    ranks: list[tuple[LayoutMap, Mapping[str, torch.Tensor]]], shapes: Mapping[str, tuple[int, ...]]
) -> dict[str, torch.Tensor]:
    """Reassemble canonical tensors from the local tensors of several ranks (the inverse mapping)."""
    out: dict[str, torch.Tensor] = {}
    for layout, tensors in ranks:
        for name, local in layout.items():
            t = tensors[name]
            for seg in local.segments:
                dst = out.get(seg.canonical)
                if dst is None:
                    dst = out[seg.canonical] = torch.empty(shapes[seg.canonical], dtype=t.dtype)
                k = len(seg.cbox) - len(seg.lbox)
                dst[_index(seg.cbox)][(0,) * k].copy_(t[_index(seg.lbox)])
    return out


def from_canonical(layout: LayoutMap, canonical: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Build one rank's local tensors from canonical tensors (fresh, contiguous)."""
    out = {}
    for name, local in layout.items():
        t = torch.empty(local.shape, dtype=next(iter(canonical.values())).dtype)
        for seg in local.segments:
            k = len(seg.cbox) - len(seg.lbox)
            t[_index(seg.lbox)] = canonical[seg.canonical][_index(seg.cbox)][(0,) * k]
        out[name] = t
    return out
