"""A rank's publication as a layout (once) and a record per version (``core.records``), and bytes beside the JSON
(``core.wire.Blob``): the whole manifest comes back equal, and every field tampered with is refused, typed."""

from __future__ import annotations

import base64
import copy
from typing import Any

import numpy as np
import pytest
import xxhash

import refitflow as rf
from refitflow.core.digests import Tiling, choose_tiling
from refitflow.core.records import (
    RankLayout,
    check_record,
    layout_from_dict,
    layout_to_dict,
    materialise,
    record_from_dict,
    record_of,
    record_to_dict,
)
from refitflow.core.types import revision_of
from refitflow.core.wire import Blob, decode, encode


def _spec(i: int, shape: tuple[int, ...], tiled: bool, seed: int) -> rf.ShardSpec:
    rows, cols = choose_tiling(shape, 2) if tiled else (0, 0)
    n = Tiling("xxh3", shape, 2, rows, cols).count
    raw = np.random.default_rng(seed * 1000 + i).integers(0, 1 << 63, n, dtype=np.uint64).astype(">u8").tobytes()
    return rf.ShardSpec(name=f"layers.{i}.w", dtype="bfloat16", global_shape=shape, axis=None, start=0,
                        stop=shape[0], digest=xxhash.xxh3_64_hexdigest(raw) if tiled else raw.hex(), region=i,
                        algo="xxh3", tile_rows=rows, tile_cols=cols,
                        blocks=base64.b64encode(raw).decode() if tiled else "")  # fmt: skip


def _manifest(version: int = 1, rank: int = 0) -> rf.Manifest:
    shards = tuple(_spec(i, (128, 256) if i % 3 else (64,), bool(i % 3), version) for i in range(12))
    return rf.Manifest(identity=rf.Identity(model="m"), version=version, rank=rank, world_size=2, shards=shards,
                       source=rf.SourceAddress(transport="nixl", agent=f"a{rank}", metadata=b"\x01\x02"),
                       metadata={"layout": "x"})  # fmt: skip


def _layout(m: rf.Manifest) -> RankLayout:
    return RankLayout(layout_from_dict(decode(encode(layout_to_dict(m)))))


def test_a_layout_and_its_records_give_every_version_back_whole_and_equal() -> None:
    layout = _layout(_manifest(1))
    assert layout.id == RankLayout.id_of(_manifest(1)) == RankLayout.id_of(_manifest(2))  # the digests play no part
    assert layout.id == RankLayout.of_checked(_manifest(2)).id
    for version in (1, 2):
        m = _manifest(version)
        record = record_from_dict(decode(encode(record_to_dict(record_of(m, layout.id)))))
        assert len(record.digests or b"") == 8 * layout.count  # raw: 8 bytes a digest, not base64
        digests = check_record(layout, record)
        assert layout.revision(record.digests or b"")[0] == revision_of(m.shards) == m.revision
        assert materialise(layout, record, digests) == m


def test_blobs_travel_raw_beside_the_json_and_a_frame_that_does_not_add_up_is_refused() -> None:
    frame = encode({"a": 1, "b": Blob(b"xy\x00z"), "c": [Blob(b"12")]})
    assert frame.endswith(b"\x00xy\x00z12") and bytes(decode(frame)["b"]) == b"xy\x00z"
    head, _, tail = frame.partition(b"\x00")
    for bad in (head + b"\x00" + tail + b"!", head + b"\x00" + tail[:-1],  # bytes no reference names; too few
                head.replace(b"[4,2]", b"[3,2]") + b"\x00" + tail,  # overlapping references
                head.replace(b"[0,4]", b"[0,-1]") + b"\x00" + tail, head.replace(b"[0,4]", b'"x"') + b"\x00" + tail):
        with pytest.raises(rf.ManifestError):
            decode(bad)


def _tampered(d: dict[str, Any], path: tuple[str, ...], value: Any) -> dict[str, Any]:
    out = copy.deepcopy(d)
    at = out
    for key in path[:-1]:
        at = at[key]
    if value is KeyError:
        del at[path[-1]]
    else:
        at[path[-1]] = value
    return out


RECORD_FIELDS = [
    (("format",), 3), (("format",), True), (("identity",), {"model": 1}), (("identity",), "m"),
    (("version",), -1), (("version",), 2**63), (("version",), 1.0), (("rank",), "0"), (("rank",), 1),
    (("layout",), "0" * 31), (("layout",), "0" * 32), (("revision",), "0" * 32), (("revision",), ""),
    (("revision",), KeyError), (("digests",), "AAAA"), (("extra",), 1),
]  # fmt: skip


@pytest.mark.parametrize(("path", "value"), RECORD_FIELDS)
def test_a_record_tampered_with_in_any_field_is_refused(path: tuple[str, ...], value: Any) -> None:
    m = _manifest(1)
    layout = _layout(m)
    d = record_to_dict(record_of(m, layout.id))
    d["digests"] = bytes(d["digests"].data)
    with pytest.raises(rf.ManifestError):
        check_record(layout, record_from_dict(_tampered(d, path, value)))


def test_a_record_whose_digests_were_changed_or_cut_is_refused_before_it_serves() -> None:
    m = _manifest(1)
    layout = _layout(m)
    raw = bytes(record_of(m, layout.id).digests or b"")
    for digests in (raw[:-8], raw + bytes(8), bytes([raw[0] ^ 1]) + raw[1:], raw[:-1] + bytes([raw[-1] ^ 1])):
        d = {**record_to_dict(record_of(m, layout.id)), "digests": digests}
        with pytest.raises(rf.ManifestError, match=r"digests for a layout|revision does not match"):
            check_record(layout, record_from_dict(d))


LAYOUT_FIELDS = [
    (("format",), 5), (("identity",), {}), (("rank",), 2), (("world_size",), 0), (("layout_digest",), 7),
    (("metadata",), {"a": 1}), (("source",), {"transport": "nixl"}), (("shards", "count"), 13),
    (("shards", "same", "digest"), ""), (("shards", "each", "name"), ["w"] * 12),
    (("shards", "each", "region"), [-1] * 12), (("extra",), 1),
]  # fmt: skip


@pytest.mark.parametrize(("path", "value"), LAYOUT_FIELDS)
def test_a_layout_tampered_with_in_any_field_is_refused(path: tuple[str, ...], value: Any) -> None:
    d = layout_to_dict(_manifest(1))
    if path[:2] == ("shards", "each") and path[-1] not in d["shards"]["each"]:
        d["shards"]["same"].pop(path[-1], None)
    with pytest.raises(rf.ManifestError):
        layout_from_dict(_tampered(d, path, value))
