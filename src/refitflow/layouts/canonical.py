"""Canonical space: the unfused, unsharded tensors every layout maps its local parameters onto.

Canonical names are the HF names of an unfused model (``q_proj``, ``gate_proj``, ``q_a_proj``,
``kv_b_proj``, ``shared_experts.gate_proj``, ...), with the MoE experts as stacked 3-D tensors
``mlp.experts.{gate,up}`` (E, F, H) and ``mlp.experts.down`` (E, H, F).
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
    "layer_shapes",
    "sliced",
    "to_canonical",
]


@dataclass(frozen=True, kw_only=True)
class ModelDims:
    """The model dimensions a layout table needs (a decoder-only transformer, dense or MoE).

    Attention is grouped-query (``heads``, ``kv_heads``, ``head_dim``) or, when ``kv_lora_rank`` is set,
    multi-head latent attention (DeepSeek-V2/V3, Kimi-K2): then ``head_dim`` is the per-head q/k width
    without rotary embedding (``qk_nope_head_dim``), ``rope_dim`` the rotary part, ``v_head_dim`` the
    value width, and ``q_lora_rank`` 0 means queries are projected straight from the hidden state.
    A MoE model's first ``dense_layers`` layers have a dense MLP of width ``ffn``; the others have
    ``experts`` experts of width ``expert_ffn``, optional shared experts (total width ``shared_ffn``) and
    an optional router score-correction bias (``router_bias``, DeepSeek-V3's ``e_score_correction_bias``).
    """

    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int = 0  # dense MLP width (every layer of a dense model; the first dense_layers of a MoE model)
    experts: int = 0
    expert_ffn: int = 0
    dense_layers: int = 0
    shared_ffn: int = 0
    router_bias: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    tied: bool = False
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    rope_dim: int = 0
    v_head_dim: int = 0

    def __post_init__(self) -> None:
        if self.heads % self.kv_heads:
            raise ConfigError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if not self.experts and (not self.ffn or self.dense_layers or self.shared_ffn or self.router_bias):
            raise ConfigError("a dense model has an MLP width (ffn) and no dense_layers, shared_ffn or router_bias")
        if self.experts and (not self.expert_ffn or bool(self.ffn) != bool(self.dense_layers)):
            raise ConfigError("a MoE model has expert_ffn, and ffn exactly when it has leading dense_layers")
        if not 0 <= self.dense_layers <= self.layers:
            raise ConfigError(f"dense_layers ({self.dense_layers}) must be within the {self.layers} layers")
        if self.mla and (self.kv_heads != self.heads or not self.rope_dim or not self.v_head_dim):
            raise ConfigError("latent attention (kv_lora_rank) needs kv_heads == heads, rope_dim and v_head_dim")
        if not self.mla and (self.q_lora_rank or self.rope_dim or self.v_head_dim):
            raise ConfigError("q_lora_rank, rope_dim and v_head_dim belong to latent attention (set kv_lora_rank)")

    @property
    def mla(self) -> bool:
        """Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2)."""
        return self.kv_lora_rank > 0

    def moe_layer(self, i: int) -> bool:
        """Whether layer ``i`` has experts (a MoE model's layers after its leading dense ones)."""
        return self.experts > 0 and i >= self.dense_layers

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


def _attention(d: ModelDims) -> dict[str, tuple[int, ...]]:
    """One layer's attention tensors, without the ``model.layers.N.`` prefix."""
    a = "self_attn."
    if d.mla:
        qk = d.head_dim + d.rope_dim
        out: dict[str, tuple[int, ...]] = {
            a + "kv_a_proj_with_mqa.weight": (d.kv_lora_rank + d.rope_dim, d.hidden),
            a + "kv_a_layernorm.weight": (d.kv_lora_rank,),
            a + "kv_b_proj.weight": (d.heads * (d.head_dim + d.v_head_dim), d.kv_lora_rank),
            a + "o_proj.weight": (d.hidden, d.heads * d.v_head_dim),
        }
        if d.q_lora_rank:
            return out | {
                a + "q_a_proj.weight": (d.q_lora_rank, d.hidden),
                a + "q_a_layernorm.weight": (d.q_lora_rank,),
                a + "q_b_proj.weight": (d.heads * qk, d.q_lora_rank),
            }
        return out | {a + "q_proj.weight": (d.heads * qk, d.hidden)}
    q, kv = d.heads * d.head_dim, d.kv_heads * d.head_dim
    out = {
        a + "q_proj.weight": (q, d.hidden),
        a + "k_proj.weight": (kv, d.hidden),
        a + "v_proj.weight": (kv, d.hidden),
        a + "o_proj.weight": (d.hidden, q),
    }
    if d.qkv_bias:
        out |= {a + "q_proj.bias": (q,), a + "k_proj.bias": (kv,), a + "v_proj.bias": (kv,)}
    if d.qk_norm:
        out |= {a + "q_norm.weight": (d.head_dim,), a + "k_norm.weight": (d.head_dim,)}
    return out


def _mlp(prefix: str, width: int, hidden: int) -> dict[str, tuple[int, ...]]:
    return {
        prefix + "gate_proj.weight": (width, hidden),
        prefix + "up_proj.weight": (width, hidden),
        prefix + "down_proj.weight": (hidden, width),
    }


def _moe(d: ModelDims) -> dict[str, tuple[int, ...]]:
    e, f = d.experts, d.expert_ffn
    out: dict[str, tuple[int, ...]] = {
        "mlp.gate.weight": (e, d.hidden),
        "mlp.experts.gate": (e, f, d.hidden),
        "mlp.experts.up": (e, f, d.hidden),
        "mlp.experts.down": (e, d.hidden, f),
    }
    if d.router_bias:
        out["mlp.gate.e_score_correction_bias"] = (e,)
    if d.shared_ffn:
        out |= _mlp("mlp.shared_experts.", d.shared_ffn, d.hidden)
    return out


def layer_shapes(d: ModelDims, i: int) -> dict[str, tuple[int, ...]]:
    """The canonical tensors of layer ``i``, without the ``model.layers.N.`` prefix."""
    norms = {"input_layernorm.weight": (d.hidden,), "post_attention_layernorm.weight": (d.hidden,)}
    return norms | _attention(d) | (_moe(d) if d.moe_layer(i) else _mlp("mlp.", d.ffn, d.hidden))


def canonical_shapes(d: ModelDims) -> dict[str, tuple[int, ...]]:
    """Every canonical tensor of the model and its shape."""
    out: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (d.vocab, d.hidden),
        "model.norm.weight": (d.hidden,),
    }
    if not d.tied:
        out["lm_head.weight"] = (d.vocab, d.hidden)
    for i in range(d.layers):
        out |= {f"model.layers.{i}.{n}": shape for n, shape in layer_shapes(d, i).items()}
    return out


def sliced(
    canonical: str, global_shape: tuple[int, ...], axis: int | None = None, start: int = 0, stop: int = 0
) -> LocalTensor:
    """The trivial layout: a local tensor is ``canonical[start:stop]`` along ``axis`` (None: all of it)."""
    shape = tuple(global_shape)
    whole = full(shape)
    if axis is None:  # plans call this once per tensor and side: the common case without a box built
        return LocalTensor(shape, (Segment(canonical, whole, whole, shape),))
    b = (*whole[:axis], (start, stop), *whole[axis + 1 :])
    return LocalTensor(shape_of(b), (Segment(canonical, b, full(shape_of(b)), shape),))


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
    """Build one rank's local tensors from canonical tensors (fresh, contiguous; unmapped padding is zero)."""
    out = {}
    for name, local in layout.items():
        t = torch.zeros(local.shape, dtype=next(iter(canonical.values())).dtype)
        for seg in local.segments:
            k = len(seg.cbox) - len(seg.lbox)
            t[_index(seg.lbox)] = canonical[seg.canonical][_index(seg.cbox)][(0,) * k]
        out[name] = t
    return out
