"""Pieces: one shard's box copies as the strided reads that pull them (``Piece``), cast checks first.

Per source shard, copies become *regions* (``regions``); regions are cut into pieces of at most a bucket
and ``max_strided_runs`` runs, each one strided read. A piece lands straight in its parameter when it is
one contiguous copy in both places with the same dtype; otherwise it is staged and *scatters* to one or
more destination boxes. A model's shards repeat their geometry layer after layer: the pieces of one
geometry (shape, dtype, tiles, boxes, destination shapes and dtypes) are computed once per plan and
given each shard's names, devices and offsets.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from typing import Any

import torch

from refitflow.core.dtypes import dtype_from_name, dtype_name
from refitflow.core.errors import PlanError
from refitflow.core.threads import breathe
from refitflow.core.types import ShardSpec
from refitflow.layouts.boxes import Box, contiguous_span, intersect, shift, strided, volume
from refitflow.planner.copies import Copy
from refitflow.planner.limits import Limits
from refitflow.planner.receiver_layout import ReceiverLayout
from refitflow.planner.records import Piece, Scatter
from refitflow.planner.regions import chunks, regions
from refitflow.planner.routes import Route

__all__ = ["check_cast", "direct_piece", "shard_pieces"]

DIRECT_PIECE = 16 << 20  # direct pieces are cut this small so the last buckets can taper


def direct_piece(batch: int) -> int:
    """The size direct pieces are cut to for batches of ``batch`` bytes: 16 MiB, or a quarter of a batch made
    larger for a large slice (``Limits.max_direct_buckets``), so pieces per batch stay few."""
    return min(batch, max(DIRECT_PIECE, batch // 4))


def check_cast(src: torch.dtype, dst: torch.dtype, lossy: bool, tensor: str) -> None:
    """Refuse (``PlanError``) a cast that loses information unless ``lossy`` casts were asked for."""
    if src == dst or lossy:
        return
    if src.is_floating_point and dst.is_floating_point and torch.promote_types(src, dst) == dst:
        if torch.finfo(dst).bits > torch.finfo(src).bits:
            return
    raise PlanError(f"casting {src} to {dst} loses information and lossy_casts is off", tensor=tensor)


def shard_pieces(cs_all: list[Copy], receiver: ReceiverLayout, limits: Limits, route: Route) -> Iterator[Piece]:
    """``route``: which destinations are assemblies (``planner/routes.py``): staged, never read into directly."""
    params, aux, assembled = receiver.dest.params, route.aux, route.assembled
    groups: dict[tuple[int, str], list[Copy]] = {}
    casts: set[tuple[str, torch.dtype, bool]] = set()
    dst_of = lambda name: aux[name] if name in aux else params[name]  # noqa: E731
    for c in cs_all:
        dst = dst_of(c.param)
        key = (c.spec.dtype, dst.dtype, c.param in assembled)
        if key not in casts:
            dtype_name(dst.dtype, tensor=c.param)
            src = dtype_from_name(c.spec.dtype, tensor=c.spec.name)
            # a parameter quantised at commit is assembled in fp32 first (an auxiliary assembly: as published)
            into = torch.float32 if key[2] and c.param not in aux else dst.dtype
            check_cast(src, into, limits.lossy_casts, c.spec.name)
            casts.add(key)
        groups.setdefault((c.source, c.spec.name), []).append(c)
    shapes: dict[Hashable, list[_Shape]] = {}  # a model's shards repeat their geometry layer after layer
    device_of = receiver.device_of
    for (source, _), cs in groups.items():
        breathe()
        spec: ShardSpec = cs[0].spec
        dsts = [dst_of(c.param) for c in cs]
        staged = tuple(c.param in assembled for c in cs)
        like = (spec.shape, spec.dtype, spec.algo, spec.tile_rows, spec.tile_cols, staged,
                tuple((c.sbox, c.dbox, t.dtype, t.shape) for c, t in zip(cs, dsts, strict=True)))  # fmt: skip
        geometry = shapes.get(like)
        if geometry is None:
            geometry = shapes[like] = _geometry(spec, cs, dsts, limits, staged)
        name, dtype, region, at = spec.name, spec.dtype, spec.region, spec.offset
        for box, (first, run, stride, count), nbytes, direct, offset, scatters, lands in geometry:
            # positional, in ``Piece``'s field order (a ~3 T model's rank makes 16,000 of them)
            yield Piece(source, name, dtype, box, first, run, stride, count, region, at, nbytes, direct, offset,
                        tuple([Scatter(cs[m].param, sub, dbox) for m, sub, dbox in scatters]),
                        device_of(cs[lands].param))  # fmt: skip


# a piece of a shard by member index: (box, runs, bytes, direct, landing offset, scatters as (member, sub,
# dbox), the member whose device it lands on: its first scatter's, else its region's first member's)
_Shape = tuple[Box, tuple[int, int, int, int], int, bool, int, list[tuple[int, Box, Box]], int]


def _geometry(
    spec: ShardSpec, cs: list[Copy], dsts: list[torch.Tensor], limits: Limits, staged: tuple[bool, ...]
) -> list[_Shape]:
    """The pieces of one shard's copies, by member index (no names: shards of one geometry share it)."""
    src_dtype = dtype_from_name(spec.dtype)
    item, shape = src_dtype.itemsize, spec.shape
    tiling = spec.tiling
    grid = _grid(tiling, len(shape))
    index = {id(c): i for i, c in enumerate(cs)}
    out: list[_Shape] = []
    for region, members in regions(cs, shape, item, limits, tiling):
        c, dst = members[0], dsts[index[id(members[0])]]
        direct = (
            len(members) == 1 and region == c.sbox and src_dtype == dst.dtype and not staged[index[id(c)]]
            and contiguous_span(region, shape) is not None and contiguous_span(c.dbox, tuple(dst.shape)) is not None
        )  # fmt: skip
        cap = direct_piece(limits.direct_bucket_bytes) if direct else limits.bucket_bytes
        for chunk in chunks(region, shape, item, cap, limits.max_strided_runs, grid):
            scatters = []
            for m in members:
                sub = intersect(chunk, m.sbox) if shape else chunk
                if sub is not None:
                    scatters.append((index[id(m)], sub, shift(sub, m.sbox, m.dbox) if shape else m.dbox))
            runs = strided(chunk, shape) if shape else (0, 1, 0, 1)
            assert runs is not None  # chunks() yields strided boxes only
            offset = 0
            if direct:
                span = contiguous_span(scatters[0][2], tuple(dst.shape))
                assert span is not None
                offset = span[0] * dst.element_size()
            lands = scatters[0][0] if scatters else index[id(c)]
            out.append((chunk, runs, volume(chunk) * item, direct, offset, scatters, lands))
    return out


def _grid(tiling: Any, ndim: int) -> tuple[int, ...] | None:
    """Per dimension, the multiple piece cuts fall on: the digest tiles' rows and columns."""
    if tiling.tile_rows == 0 or ndim == 0:
        return None
    if ndim == 1:
        return (tiling.tile_cols,)
    return (*([1] * (ndim - 2)), tiling.tile_rows, tiling.tile_cols)
