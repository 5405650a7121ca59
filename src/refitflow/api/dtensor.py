"""A ``DTensor`` parameter (FSDP2's ``fully_shard``, ``distribute_tensor``) as this rank's shard.

Each rank publishes only its local tensor, in place, never gathered: its box in the global tensor
follows from the placements and the rank's mesh coordinate. ``Shard(d)`` splits dimension ``d`` as
``torch.chunk`` does (chunks of ``ceil(n / k)`` rows, so the last chunks may be shorter or empty —
``fully_shard`` pads its own storage, but the local tensor is the unpadded part); ``Replicate()``
keeps the whole dimension. Ranks that hold the same box publish it each: the planner treats
identical boxes from several sources as replicas and spreads its reads over them, so no rank is
singled out and every replica's bytes are checked against its own digests.

Supported: every placement ``Replicate()`` or ``Shard(d)``, with at most one mesh dimension sharding
the tensor (a shard spec has one axis). ``Partial`` (unreduced values), ``_StridedShard`` (FSDP over
TP on the same dimension) and a tensor split over several mesh dimensions are a ``ConfigError``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from refitflow.api._sharded import Sharded
from refitflow.core.errors import ConfigError

__all__ = ["chunk_range", "is_dtensor", "local_part", "shard_box"]


def chunk_range(size: int, chunks: int, index: int) -> tuple[int, int]:
    """``[start, stop)`` of chunk ``index`` of ``size`` rows cut in ``chunks``, as ``torch.chunk`` cuts."""
    step = -(-size // chunks)
    start = min(index * step, size)
    return start, min(start + step, size)


def shard_box(
    name: str, shape: tuple[int, ...], mesh_shape: Sequence[int], coordinate: Sequence[int], placements: Sequence[Any]
) -> tuple[int | None, int, int]:
    """``(axis, start, stop)``: the range of ``shape`` along ``axis`` the rank at ``coordinate`` holds
    (``axis`` ``None``: the whole tensor). A mesh dimension of size 1 splits nothing."""
    from torch.distributed.tensor import Replicate, Shard

    sharded: list[tuple[int, int]] = []  # (mesh dim, tensor dim)
    for mdim, p in enumerate(placements):
        if type(p) is Shard:  # not a subclass (_StridedShard interleaves)
            if mesh_shape[mdim] > 1:
                sharded.append((mdim, p.dim % len(shape)))
        elif not isinstance(p, Replicate):
            raise ConfigError(
                f"{name!r}: placement {p} on mesh dimension {mdim} is not supported (only Shard(d) and "
                "Replicate(); redistribute a Partial tensor to Replicate() or Shard(d) before publishing)"
            )
    if not sharded:
        return None, 0, shape[0] if shape else 1
    if len(sharded) > 1:
        raise ConfigError(
            f"{name!r}: placements {tuple(placements)} split it over {len(sharded)} mesh dimensions; "
            "a published shard is one range along one dimension"
        )
    mdim, axis = sharded[0]
    return axis, *chunk_range(shape[axis], mesh_shape[mdim], coordinate[mdim])


def is_dtensor(value: Any) -> bool:
    """Without importing ``torch.distributed.tensor`` (a second's import): a DTensor implies its module."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)


def local_part(name: str, value: Any) -> Any:
    """``value`` itself unless it is a DTensor; a DTensor's local tensor (replicated: the whole tensor)
    or ``Sharded`` along its one sharded dimension; ``None`` when this rank's chunk is empty (it
    publishes nothing for the tensor)."""
    if not is_dtensor(value):
        return value
    mesh, shape = value.device_mesh, tuple(value.shape)
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise ConfigError(f"{name!r}: this rank is not in the DTensor's device mesh")
    axis, start, stop = shard_box(name, shape, tuple(mesh.shape), coordinate, value.placements)
    local = value.to_local()
    expected = shape if axis is None else (*shape[:axis], stop - start, *shape[axis + 1 :])
    if tuple(local.shape) != expected:
        raise ConfigError(
            f"{name!r}: local tensor {tuple(local.shape)} is not the {expected} its placements give "
            f"(global {shape}, {tuple(value.placements)})"
        )
    if axis is None:
        return local
    if stop == start:
        return None
    return Sharded(tensor=local, axis=axis, start=start, global_shape=shape)
