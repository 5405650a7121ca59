"""The frozen wire format, pinned: constants, field order, the bytes of a known bucket, the bucketing
rule, and every check a bucket's metadata must pass (a ``FrameError`` naming the entry)."""

from __future__ import annotations

import struct

import anyio
import orjson
import pytest
import torch

import refitflow as rf
from refitflow.push import format as fmt
from tests.push._inproc import groups, together

KNOWN = {"a": torch.tensor([0, 1, 2], dtype=torch.int32), "b": torch.tensor([[1.0, -2.0]], dtype=torch.float16)}
KNOWN_METADATA = (
    b'[{"name":"a","shape":[3],"dtype":"int32","offset":0,"nbytes":12},'
    b'{"name":"b","shape":[1,2],"dtype":"float16","offset":12,"nbytes":4}]'
)
KNOWN_PAYLOAD = struct.pack("<3i", 0, 1, 2) + b"\x00\x3c\x00\xc0"  # int32 0,1,2 then float16 1.0, -2.0


def test_constants_and_field_order_are_the_frozen_ones() -> None:
    assert (fmt.CMD_END, fmt.CMD_BUCKET) == (0, 1)
    assert fmt.HEADER_FIELDS == ("command", "metadata_bytes", "payload_bytes", "version")
    assert fmt.Header._fields == fmt.HEADER_FIELDS and fmt.HEADER_DTYPE is torch.int64
    assert fmt.ENTRY_KEYS == ("name", "shape", "dtype", "offset", "nbytes")
    assert fmt.METADATA_CEILING == 64 * 2**20
    assert fmt.Header.end(9) == (0, 0, 0, 9)


def test_a_known_bucket_encodes_to_these_bytes() -> None:
    entries = fmt.pack_offsets(list(KNOWN.items()))
    assert fmt.encode_metadata(entries) == KNOWN_METADATA
    header = fmt.Header(fmt.CMD_BUCKET, len(KNOWN_METADATA), len(KNOWN_PAYLOAD), 7).tensor()
    assert header.numpy().tobytes() == struct.pack("<4q", 1, len(KNOWN_METADATA), 16, 7)
    assert fmt.decode_metadata(KNOWN_METADATA, 16) == entries


@pytest.mark.asyncio
async def test_the_sender_broadcasts_exactly_the_known_frames() -> None:
    sender_group, reader = await groups(2)
    got: list[bytes] = []

    def read_raw() -> None:
        """Read the stream with nothing but the format: header, metadata, payload, end marker."""
        header = torch.empty(4, dtype=torch.int64)
        reader.broadcast_sync(header, 0)
        got.append(header.numpy().tobytes())
        command, meta_n, payload_n, _ = header.tolist()
        assert command == 1
        for n in (meta_n, payload_n):
            buf = torch.empty(n, dtype=torch.uint8)
            reader.broadcast_sync(buf, 0)
            got.append(buf.numpy().tobytes())
        reader.broadcast_sync(header, 0)
        got.append(header.numpy().tobytes())

    sender = rf.StreamSender(sender_group, bucket_bytes=1024)
    sent, _ = await together(lambda: sender.send(7, KNOWN), lambda: anyio.to_thread.run_sync(read_raw))
    assert not isinstance(sent, BaseException), sent
    assert (sent.buckets, sent.nbytes) == (1, 16)
    assert got == [
        struct.pack("<4q", 1, len(KNOWN_METADATA), 16, 7),
        KNOWN_METADATA,
        KNOWN_PAYLOAD,
        struct.pack("<4q", 0, 0, 0, 7),
    ]


@pytest.mark.parametrize(
    ("sizes", "limit", "buckets"),
    [
        ([10, 10, 10], 25, [[0, 1], [2]]),  # 10 + 10 + 10 would overflow: flush before the third
        ([10, 15, 1], 25, [[0, 1], [2]]),  # reaching the limit exactly flushes after adding
        ([30, 5], 25, [[0], [1]]),  # an oversize tensor travels alone
        ([5, 30, 5], 25, [[0], [1], [2]]),  # flushed before it (non-empty bucket) and after it
        ([25], 25, [[0]]),
        ([], 25, []),
    ],
)
def test_bucketing_follows_the_frozen_rule(sizes: list[int], limit: int, buckets: list[list[int]]) -> None:
    assert [list(r) for r in fmt.bucket_ranges(sizes, limit)] == buckets


def _meta(*entries: dict) -> bytes:
    return orjson.dumps(list(entries))


def _e(name: str = "w", shape: list | None = None, dtype: str = "float32", offset: int = 0, nbytes: int = 16) -> dict:
    return {"name": name, "shape": [4] if shape is None else shape, "dtype": dtype, "offset": offset, "nbytes": nbytes}


REFUSED = {
    "nbytes_past_the_payload_end": (_meta(_e(offset=20)), "entry", "past the payload end"),
    "nbytes_zero": (_meta(_e(shape=[0], nbytes=0)), "entry", "nbytes must be a positive integer"),
    "negative_offset": (_meta(_e(offset=-4)), "entry", "offset must be a non-negative integer"),
    "shape_times_dtype_is_not_nbytes": (_meta(_e(nbytes=8)), "entry", "nbytes says 8"),
    "missing_key": (_meta({"name": "w", "shape": [4], "offset": 0, "nbytes": 16}), "entry", "missing key(s) ['dtype']"),
    "unknown_key": (_meta(_e() | {"stride": [1]}), "entry", "unknown key(s) ['stride']"),
    "unknown_dtype": (_meta(_e(dtype="float4_e2m1")), "entry", "unknown dtype 'float4_e2m1'"),
    "torch_prefixed_dtype": (_meta(_e(dtype="torch.float32")), "entry", "unknown dtype"),
    "bool_shape": (_meta(_e(shape=[True, 4], nbytes=16)), "entry", "shape must be a list of non-negative integers"),
    "empty_list": (b"[]", "metadata", "an empty list"),
    "not_a_list": (b'{"name": "w"}', "metadata", "got dict"),
    "repeated_name": (_meta(_e(), _e(offset=16)), "entry", "repeated name"),
    "overlapping_byte_ranges": (_meta(_e(), _e(name="v", offset=12)), "entry", "overlap 'w' [0, 16)"),
    "not_json": (b'[{"name": "w", "shape"', "metadata", "not JSON"),
    "not_utf8": (b'[{"name": "\xff"}]', "metadata", "not JSON"),
    "entry_not_an_object": (b"[1]", "entry", "not a JSON object"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_each_malformed_bucket_is_refused_naming_its_entry(case: str) -> None:
    raw, kind, words = REFUSED[case]
    with pytest.raises(rf.FrameError) as info:
        fmt.decode_metadata(raw, 32, version=3)
    assert info.value.kind == kind and words in str(info.value) and info.value.version == 3
    assert isinstance(info.value, rf.ManifestError)
    if kind == "entry" and case not in ("entry_not_an_object",):
        assert info.value.tensor in ("w", "v"), "the refusal names the entry"


def test_gaps_between_entries_are_allowed() -> None:
    entries = fmt.decode_metadata(_meta(_e(offset=16), _e(name="v", offset=48)), 64)
    assert [(e.name, e.offset) for e in entries] == [("w", 16), ("v", 48)]
