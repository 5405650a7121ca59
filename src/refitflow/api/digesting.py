"""The publisher's digests: each shard's tile geometry, its digest fields in a ``ShardSpec``, and the one
digest pass per process (``Publisher.publish`` runs it in a worker thread). Geometry and algorithms:
``core/digests.py``, ``core/hashing.py``."""

from __future__ import annotations

import base64
import binascii
import functools
import math
import threading
from typing import Any

import numpy as np
import torch
import xxhash

from refitflow.core.digests import ALGORITHMS, Tiling, choose_tiling
from refitflow.core.hashing import mix64_box_on_device, shard_digests, to_host
from refitflow.layouts.boxes import full

__all__ = [
    "DIGEST_CHOICES",
    "DIGEST_FIELDS",
    "Digests",
    "digest",
    "digest_algorithm",
    "digest_columns",
    "pending_columns",
]


DIGEST_CHOICES = ("auto", *ALGORITHMS)


def digest_algorithm(tensor: torch.Tensor, choice: str) -> str:
    """``auto``: mix64 for a tensor on an accelerator (hashed there), xxh3 on the CPU (fastest there)."""
    if choice != "auto":
        return choice
    return "xxh3" if tensor.is_cpu else "mix64"


def _tiling(tensor: torch.Tensor, algo: str, columns: bool = True) -> Tiling:
    return _tiling_of(tuple(tensor.shape), tensor.element_size(), algo, columns)


@functools.lru_cache(maxsize=1 << 12)
def _tiling_of(shape: tuple[int, ...], item: int, algo: str, columns: bool = True) -> Tiling:
    """The publisher's tiling of a shard, per geometry: a model's shards repeat a few, and the layout announced
    early and the digest pass both ask for it."""
    rows, cols = choose_tiling(shape, item, columns) if math.prod(shape) else (0, 0)
    return Tiling(algo, shape, item, rows, cols)


DIGEST_FIELDS = {"algo": "xxh3", "tile_rows": 0, "tile_cols": 0, "blocks": "", "digest": ""}  # and their defaults
Digests = tuple[str, int, int, str, str]  # a shard's values of ``DIGEST_FIELDS``, in that order


def _fields(tiling: Tiling, digests: np.ndarray) -> Digests:
    raw = digests.astype(">u8").tobytes()
    if not tiling.tile_rows:  # an empty shard: its one digest
        return (tiling.algo, 0, 0, "", raw.hex())
    return (tiling.algo, tiling.tile_rows, tiling.tile_cols, base64.b64encode(raw).decode(),
            xxhash.xxh3_64_hexdigest(raw))  # fmt: skip


_NUMPY = {torch.float64, torch.float32, torch.float16, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8}


def _one_unit(tensor: torch.Tensor, tiling: Tiling) -> Digests:
    """``_fields(tiling, shard_digests(tensor, tiling))`` of a contiguous CPU shard that is one xxh3 unit, without
    the arrays: its bytes hashed whole, the one digest encoded directly."""
    # its bytes as a buffer: numpy's view of the tensor where numpy has the dtype (one torch call), else bytes
    tensor = tensor.detach() if tensor.requires_grad else tensor
    data: Any = tensor.numpy() if tensor.dtype in _NUMPY else tensor.reshape(-1).view(torch.uint8).numpy()
    raw = xxhash.xxh3_64_intdigest(data).to_bytes(8, "big")
    blocks = binascii.b2a_base64(raw, newline=False).decode()
    return ("xxh3", tiling.tile_rows, tiling.tile_cols, blocks, xxhash.xxh3_64_hexdigest(raw))


def pending_columns(tilings: list[Tiling]) -> dict[str, list[Any]]:
    """The digest columns of pending shards: the geometry, no values (two-phase publication)."""
    n = len(tilings)
    return {"algo": [t.algo for t in tilings], "tile_rows": [t.tile_rows for t in tilings],
            "tile_cols": [t.tile_cols for t in tilings], "blocks": [""] * n, "digest": [""] * n}  # fmt: skip


def digest_columns(fields: list[Digests]) -> dict[str, list[Any]]:
    """The digest columns of ``_digest_all``'s values."""
    if not fields:
        return {f: [] for f in DIGEST_FIELDS}
    return dict(zip(DIGEST_FIELDS, map(list, zip(*fields, strict=True)), strict=True))


def digest(tensor: torch.Tensor, algo: str = "xxh3") -> dict[str, Any]:
    """The digest fields of a ``ShardSpec`` for a contiguous tensor, computed on its own device."""
    tiling = _tiling(tensor, algo)
    return dict(zip(DIGEST_FIELDS, _fields(tiling, shard_digests(tensor, tiling)), strict=True))


def _digest_all(
    items: list[tuple[torch.Tensor, str]], columns: bool = True, tilings: list[Tiling] | None = None
) -> list[Digests]:
    """Digest fields of every tensor; mix64 sums stay on their device until one copy per device brings
    them all to the host (no synchronisation per tensor). Run in one worker thread off the event loop.
    ``tilings``: each tensor's (``_tiling``), when the caller has them.

    One thread, not two: python-xxhash keeps the GIL while it hashes an input under ~100 KiB (a tile), so
    two threads mostly took turns, and ran 1.1–1.6× slower than one (`bench/digest_bench.py`, 2 cores);
    hashing the row blocks apart from the tiles' gather, in a second thread, was slower still (the gather
    then reads the rows from memory, not from cache: 83–115 ms against 64 ms for the bench's model)."""
    out: list[Digests | None] = [None] * len(items)
    pending: dict[torch.device, list[tuple[int, Tiling, torch.Tensor]]] = {}
    if tilings is None:
        tilings = [_tiling(t, algo, columns) for t, algo in items]
    for i, ((t, algo), tiling) in enumerate(zip(items, tilings, strict=True)):
        if tiling.count == 1 and algo == "xxh3" and tiling.tile_rows and t.is_cpu:
            out[i] = _one_unit(t, tiling)  # most of a model's small tensors: ≈ 1 µs, not 4
        elif algo == "mix64":  # on any device the same way (CPU tests run the accelerator's path)
            pending.setdefault(t.device, []).append((i, tiling, mix64_box_on_device(t, tiling, full(t.shape))))
        else:
            out[i] = _fields(tiling, shard_digests(t, tiling))
    for group in pending.values():
        sums = to_host(torch.cat([s for _, _, s in group]))
        at = 0
        for i, tiling, s in group:
            out[i] = _fields(tiling, sums[at : at + len(s)])
            at += len(s)
    return [d for d in out if d is not None]


_digesting = threading.Lock()


def _digest_one_at_a_time(
    items: list[tuple[torch.Tensor, str]], columns: bool = True, tilings: list[Tiling] | None = None
) -> list[Digests]:
    """``_digest_all``, one pass at a time in this process: publishers of several ranks in one process (as in
    ``python -m bench`` with ``announce_early``) would otherwise take turns on the GIL tile by tile, and
    the two passes end later than one after the other (``bench/digest_bench.py``: the same pass split
    over two threads 83 ms, in one thread 64 ms)."""
    with _digesting:
        return _digest_all(items, columns, tilings)
