"""FP8 publications and FP8 receivers for ``bench/simulate.py``, shape only, through refitflow's own quant path.

The trainer publishes its linear weights — attention projections, dense and shared MLPs, every expert — as
``fp8_block128`` pairs (float8_e4m3fn values of 128 × 128 blocks beside their float32 ``W_scale_inv``), as
DeepSeek-V3's and Kimi-K2's checkpoints are; embeddings, the output layer, the router, norms and biases stay
bf16. Each rank's ``metadata["quant"]`` is what ``Publisher.publish`` announces: the publisher's own
``quant_metadata`` (``layouts/quant_layout.py``), which also refuses a trainer layout that cuts a block.

A receiver holds a linear weight in FP8 with its scales (vLLM's ``W`` and ``W_scale_inv``) where its slice
keeps every 128 × 128 block whole — then the planner routes it ``copy``: values and scales read as they are —
and in bf16 where its slice cuts blocks (vLLM's block-FP8 linear refuses such a partition: DeepSeek-V3's dense
MLP at TP 32 is 576 rows a rank, a 2,048-wide shared expert 64): those the planner routes ``convert``, whole
blocks read and dequantised exactly. Plans, bytes, buckets and reads are the planner's (``planner/routes.py``).
"""

from __future__ import annotations

import base64
from collections.abc import Mapping

import torch

import refitflow as rf
from refitflow.core.digests import Tiling, choose_tiling
from refitflow.layouts.canonical import LocalTensor
from refitflow.layouts.quant import FORMATS
from refitflow.layouts.quant_layout import quant_metadata, scale_layout

__all__ = ["FP8", "fp8_landing", "fp8_linear", "spec", "trainer_shards"]

FP8 = FORMATS["fp8_block128"]
_PLAIN = ("word_embeddings", "output_layer", ".router.", "embed_tokens", "lm_head", ".mlp.gate.")


def fp8_linear(name: str, shape: tuple[int, ...]) -> bool:
    """A linear layer's weight (what an FP8 checkpoint quantises): 2-D or more, not an embedding, the output
    layer or the router (Megatron's names and vLLM's)."""
    return len(shape) >= 2 and not any(p in name for p in _PLAIN)


def spec(name: str, shape: tuple[int, ...], dtype: str, itemsize: int) -> rf.ShardSpec:
    """A shape-only shard: the publisher's tile geometry, zero digests, no bytes (as kimi_plan_bench)."""
    rows, cols = choose_tiling(shape, itemsize)
    blocks = base64.b64encode(bytes(8 * Tiling("xxh3", shape, itemsize, rows, cols).count)).decode()
    return rf.ShardSpec(
        name=name, dtype=dtype, global_shape=shape, axis=None, start=0, stop=shape[0] if shape else 1,
        digest="0" * 16, region=0, algo="xxh3", tile_rows=rows, tile_cols=cols, blocks=blocks,
    )  # fmt: skip


def trainer_shards(
    layout: Mapping[str, LocalTensor], meta: Mapping[str, str], fp8: bool
) -> tuple[tuple[rf.ShardSpec, ...], dict[str, str]]:
    """One trainer rank's shards (bf16, or its linear weights as FP8 pairs) and its metadata with the
    publisher's ``metadata["quant"]``."""
    if not fp8:
        return tuple(spec(n, lt.shape, "bfloat16", 2) for n, lt in layout.items()), dict(meta)
    shards, tensors = [], {}
    for n, lt in layout.items():
        if not fp8_linear(n, lt.shape):
            shards.append(spec(n, lt.shape, "bfloat16", 2))
            continue
        scales = FP8.scale_shape(lt.shape)
        shards += [spec(n, lt.shape, "float8_e4m3fn", 1), spec(n + FP8.scale_suffix, scales, "float32", 4)]
        tensors[n] = torch.empty(lt.shape, dtype=FP8.values, device="meta")
        tensors[n + FP8.scale_suffix] = torch.empty(scales, dtype=FP8.scale, device="meta")
    return tuple(shards), dict(meta) | quant_metadata(tensors, None, meta)


def fp8_landing(layout: Mapping[str, LocalTensor], shapes: Mapping[str, tuple[int, ...]], fp8: bool
                ) -> dict[str, torch.Tensor]:  # fmt: skip
    """A vLLM rank's parameters as meta tensors: bf16, or (``fp8``) its linear weights in FP8 with their
    scales where its slice keeps every block whole (``shapes``: the canonical tensors')."""
    out = {}
    for n, lt in layout.items():
        if fp8 and fp8_linear(n, lt.shape) and scale_layout(FP8, lt, shapes) is not None:
            out[n] = torch.empty(lt.shape, dtype=FP8.values, device="meta")
            out[n + FP8.scale_suffix] = torch.empty(FP8.scale_shape(lt.shape), dtype=FP8.scale, device="meta")
        else:
            out[n] = torch.empty(lt.shape, dtype=torch.bfloat16, device="meta")
    return out
