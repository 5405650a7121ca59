"""The frozen wire format of the ATOM / LumenRL weight stream (matched byte for byte).

Per bucket, three broadcasts from the sender (group rank ``src``):

1. header ``int64[4] = [command, metadata_bytes, payload_bytes, version]``; command 1 = bucket;
2. metadata ``uint8[metadata_bytes]``: compact UTF-8 JSON list of
   ``{"name", "shape", "dtype", "offset", "nbytes"}`` (dtype: the torch name without ``torch.``);
3. payload ``uint8[payload_bytes]``: the tensors packed back to back (each entry a view into it).

End of stream: one header ``[0, 0, 0, version]`` and nothing after it. A frame with another command
still carries its metadata and payload broadcasts (of the sizes its header gives).

Bucketing (``bucket_ranges``): flush before a tensor that would overflow a non-empty bucket; flush
after adding once the size reaches the limit (so an oversize tensor travels alone).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import orjson
import torch

from refitflow.core.dtypes import dtype_from_name
from refitflow.core.errors import FrameError, PlanError

__all__ = [
    "CMD_BUCKET",
    "CMD_END",
    "ENTRY_KEYS",
    "HEADER_DTYPE",
    "HEADER_FIELDS",
    "METADATA_CEILING",
    "Entry",
    "Header",
    "bucket_ranges",
    "decode_metadata",
    "encode_metadata",
    "pack_offsets",
]

CMD_END = 0
CMD_BUCKET = 1
HEADER_FIELDS = ("command", "metadata_bytes", "payload_bytes", "version")
HEADER_DTYPE = torch.int64
ENTRY_KEYS = ("name", "shape", "dtype", "offset", "nbytes")  # the order every entry's keys are written in
METADATA_CEILING = 64 << 20  # a receiver never allocates more metadata than this for one frame


class Header(NamedTuple):
    command: int
    metadata_bytes: int
    payload_bytes: int
    version: int

    def tensor(self, device: torch.device | str = "cpu") -> torch.Tensor:
        return torch.tensor(list(self), dtype=HEADER_DTYPE, device=device)

    @classmethod
    def end(cls, version: int) -> Header:
        return cls(CMD_END, 0, 0, version)


@dataclass(frozen=True, slots=True)
class Entry:
    """One tensor of a bucket: ``payload[offset : offset + nbytes]`` viewed as ``dtype`` of ``shape``."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int
    nbytes: int


def encode_metadata(entries: Sequence[Entry]) -> bytes:
    """Compact UTF-8 JSON, keys in ``ENTRY_KEYS`` order."""
    return orjson.dumps(
        [{"name": e.name, "shape": list(e.shape), "dtype": e.dtype, "offset": e.offset, "nbytes": e.nbytes}
         for e in entries]
    )  # fmt: skip


def pack_offsets(tensors: Sequence[tuple[str, torch.Tensor]]) -> list[Entry]:
    """The entries of tensors packed back to back from offset 0, in order."""
    out, at = [], 0
    for name, t in tensors:
        dtype = str(t.dtype).removeprefix("torch.")
        out.append(Entry(name, tuple(t.shape), dtype, at, t.numel() * t.element_size()))
        at += out[-1].nbytes
    return out


def bucket_ranges(sizes: Sequence[int], limit: int) -> list[range]:
    """The frozen bucketing rule over tensor byte sizes: index ranges, one per bucket, in order."""
    out: list[range] = []
    start, size = 0, 0
    for i, n in enumerate(sizes):
        if i > start and size + n > limit:  # would overflow a non-empty bucket: flush before it
            out.append(range(start, i))
            start, size = i, 0
        size += n
        if size >= limit:  # reached the limit: flush after it
            out.append(range(start, i + 1))
            start, size = i + 1, 0
    if start < len(sizes):
        out.append(range(start, len(sizes)))
    return out


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _entry(i: int, raw: Any, payload_bytes: int, version: int | None) -> Entry:
    where = f"metadata entry {i}"

    def refuse(what: str, name: str | None = None) -> FrameError:
        return FrameError(f"{where}: {what}", kind="entry", version=version, tensor=name)

    if not isinstance(raw, dict):
        raise refuse(f"not a JSON object but {type(raw).__name__}")
    name = raw.get("name")
    shown = name if isinstance(name, str) else None
    missing = [k for k in ENTRY_KEYS if k not in raw]
    if missing:
        raise refuse(f"missing key(s) {missing}", shown)
    extra = sorted(set(raw) - set(ENTRY_KEYS))
    if extra:
        raise refuse(f"unknown key(s) {extra}", shown)
    if not isinstance(name, str) or not name:
        raise refuse(f"name must be a non-empty string, got {name!r}")
    shape, dtype, offset, nbytes = raw["shape"], raw["dtype"], raw["offset"], raw["nbytes"]
    if not isinstance(shape, list) or not all(_int(d) and d >= 0 for d in shape):
        raise refuse(f"shape must be a list of non-negative integers, got {shape!r}", name)
    try:
        item = dtype_from_name(dtype).itemsize
    except PlanError as exc:
        raise refuse(exc.reason, name) from None
    if not _int(offset) or offset < 0:
        raise refuse(f"offset must be a non-negative integer, got {offset!r}", name)
    if not _int(nbytes) or nbytes <= 0:
        raise refuse(f"nbytes must be a positive integer, got {nbytes!r}", name)
    if math.prod(shape) * item != nbytes:
        raise refuse(f"shape {shape} of {dtype} is {math.prod(shape) * item} bytes, nbytes says {nbytes}", name)
    if offset + nbytes > payload_bytes:
        raise refuse(f"bytes [{offset}, {offset + nbytes}) run past the payload end ({payload_bytes})", name)
    return Entry(name, tuple(shape), dtype, offset, nbytes)


def decode_metadata(raw: bytes, payload_bytes: int, *, version: int | None = None) -> list[Entry]:
    """Parse and check one bucket's metadata against its payload size; ``FrameError`` naming the entry."""
    try:
        items = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise FrameError(f"metadata is not JSON: {exc}", kind="metadata", version=version) from exc
    if not isinstance(items, list) or not items:
        what = "an empty list" if isinstance(items, list) else type(items).__name__
        raise FrameError(f"metadata must be a non-empty JSON list of entries, got {what}", kind="metadata",
                         version=version)  # fmt: skip
    entries = [_entry(i, item, payload_bytes, version) for i, item in enumerate(items)]
    seen: set[str] = set()
    for e in entries:
        if e.name in seen:
            raise FrameError("repeated name in one bucket", kind="entry", version=version, tensor=e.name)
        seen.add(e.name)
    ordered = sorted(entries, key=lambda e: e.offset)
    for a, b in itertools.pairwise(ordered):  # gaps are allowed, overlaps are not
        if b.offset < a.offset + a.nbytes:
            raise FrameError(
                f"bytes [{b.offset}, {b.offset + b.nbytes}) overlap {a.name!r} [{a.offset}, {a.offset + a.nbytes})",
                kind="entry", version=version, tensor=b.name,
            )  # fmt: skip
    return entries
