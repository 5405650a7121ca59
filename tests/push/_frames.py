"""Raw stream frames for tests: a good stream built by hand from the frozen format, and each malformed
case of issue 14 made from it (a sender that gets the format wrong, not a mock of one)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import orjson
import torch

from refitflow.push.format import CMD_BUCKET, Header, bucket_ranges, encode_metadata, pack_offsets
from refitflow.push.group import StreamGroup
from refitflow.transports.base import as_bytes

BUCKET_BYTES = 4096


@dataclass(frozen=True)
class Frame:
    header: Header
    metadata: bytes = b""
    payload: torch.Tensor | None = None


def weights(version: int) -> dict[str, torch.Tensor]:
    """The trainer's weights at ``version``, in an order whose first bucket holds several entries and
    whose second is an oversize tensor travelling alone (``BUCKET_BYTES``)."""
    torch.manual_seed(100)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    params = {n: p.detach() + 0.25 * version for n, p in model.named_parameters()}
    return {n: params[n].contiguous() for n in ("0.bias", "2.weight", "2.bias", "0.weight")}


def server(seed: int) -> torch.nn.Module:
    """A receiving model of the same architecture (its own initial weights)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))


def good(version: int, tensors: dict[str, torch.Tensor], bucket_bytes: int = BUCKET_BYTES) -> list[Frame]:
    items = list(tensors.items())
    out = []
    for r in bucket_ranges([t.nbytes for _, t in items], bucket_bytes):
        chunk = items[r.start : r.stop]
        entries = pack_offsets(chunk)
        payload = torch.cat([as_bytes(t) for _, t in chunk])
        meta = encode_metadata(entries)
        out.append(Frame(Header(CMD_BUCKET, len(meta), payload.numel(), version), meta, payload))
    return [*out, Frame(Header.end(version))]


def _edit(frame: Frame, edit: Callable[[list[dict]], object]) -> Frame:
    entries = orjson.loads(frame.metadata)
    edit(entries)
    meta = orjson.dumps(entries)
    return Frame(frame.header._replace(metadata_bytes=len(meta)), meta, frame.payload)


def _set(i: int, key: str, value: object) -> Callable[[list[dict]], None]:
    def edit(entries: list[dict]) -> None:
        entries[i][key] = value

    return edit


def _raw(frame: Frame, meta: bytes) -> Frame:
    return Frame(frame.header._replace(metadata_bytes=len(meta)), meta, frame.payload)


def _truncated(frame: Frame) -> Frame:
    assert frame.payload is not None
    cut = frame.payload[:-4]
    return Frame(frame.header._replace(payload_bytes=cut.numel()), frame.metadata, cut)


# case -> (kind of the FrameError, does the refused frame come after a bucket that was written)
CASES: dict[str, tuple[str, bool]] = {
    "past_end": ("entry", False),
    "zero_nbytes": ("entry", False),
    "negative_offset": ("entry", False),
    "size_mismatch": ("entry", False),
    "missing_key": ("entry", False),
    "unknown_dtype": ("entry", False),
    "empty_list": ("metadata", False),
    "repeated_name": ("entry", False),
    "overlap": ("entry", False),
    "not_json": ("metadata", False),
    "end_sizes": ("header", False),
    "unknown_command": ("command", False),
    "header_version": ("header", True),  # the stream's version is its first header's: a later header differs
}


def malformed(case: str, version: int, tensors: dict[str, torch.Tensor]) -> list[Frame]:
    """A stream of ``version`` whose first refused frame is ``case``; good buckets follow it."""
    frames = good(version, tensors)
    first, rest = frames[0], frames[1:]
    edits = {
        "zero_nbytes": _set(0, "nbytes", 0),
        "negative_offset": _set(0, "offset", -8),
        "size_mismatch": _set(0, "nbytes", 4),
        "missing_key": lambda e: e[0].pop("dtype"),
        "unknown_dtype": _set(1, "dtype", "float4_e2m1"),
        "repeated_name": _set(1, "name", "0.bias"),
        "overlap": _set(1, "offset", 4),
    }
    if case in edits:
        return [_edit(first, edits[case]), *rest]
    if case == "past_end":
        return [_truncated(first), *rest]
    if case == "empty_list":
        return [_raw(first, b"[]"), *rest]
    if case == "not_json":
        return [_raw(first, b'[{"name": "0.bias", "shape"'), *rest]
    if case == "header_version":
        second = rest[0]
        return [first, Frame(second.header._replace(version=version + 1), second.metadata, second.payload), *rest[1:]]
    if case == "end_sizes":
        return [Frame(Header(0, 3, 5, version))]
    if case == "unknown_command":
        return [Frame(first.header._replace(command=7), first.metadata, first.payload), *frames]
    raise KeyError(case)


def send(group: StreamGroup, frames: list[Frame], src: int = 0) -> None:
    """Broadcast raw frames: a header, then (not after an end marker) metadata and payload."""
    for f in frames:
        group.broadcast_sync(f.header.tensor(), src)
        if f.header.command == 0:
            continue
        group.broadcast_sync(torch.tensor(list(f.metadata), dtype=torch.uint8), src)
        payload = f.payload if f.payload is not None else torch.empty(0, dtype=torch.uint8)
        group.broadcast_sync(payload, src)
