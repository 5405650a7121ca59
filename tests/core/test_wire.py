"""Manifests survive the wire; malformed ones are refused with ManifestError."""

from __future__ import annotations

import dataclasses

import pytest

import refitflow as rf
from refitflow.core.wire import decode, encode, manifest_from_dict, manifest_to_dict


def _manifest() -> rf.Manifest:
    spec = rf.ShardSpec(
        name="w", dtype="bfloat16", global_shape=(8, 4), axis=0, start=0, stop=4, digest="0123456789abcdef", region=3
    )
    return rf.Manifest(
        identity=rf.Identity(model="m"), version=7, rank=0, world_size=2,
        source=rf.SourceAddress(transport="nixl", agent="a", metadata=b"\x00\x01"), shards=(spec,),
    )  # fmt: skip


def test_manifest_roundtrip() -> None:
    m = _manifest()
    back = manifest_from_dict(decode(encode(manifest_to_dict(m))))
    assert back == m and back.revision == m.revision and back.shards[0].nbytes == 4 * 4 * 2


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d.pop("shards"),
        lambda d: d.__setitem__("version", "7"),
        lambda d: d.__setitem__("version", True),
        lambda d: d.__setitem__("rank", 5),
        lambda d: d["shards"]["same"].__setitem__("dtype", "float7"),
        lambda d: d["shards"]["same"].__setitem__("stop", 99),
        lambda d: d["shards"]["same"].__setitem__("digest", ""),
        lambda d: d["shards"]["same"].__setitem__("digest", "0123456789abcdeg"),  # not hexadecimal
        lambda d: d["shards"].__setitem__("count", 2),  # the one shard twice
        lambda d: d.__setitem__("revision", "0" * 32),
        lambda d: d["identity"].__setitem__("colour", "red"),
        lambda d: d["source"].__setitem__("metadata", "!!"),
    ],
)
def test_malformed_manifests_are_refused(mutate) -> None:
    d = manifest_to_dict(_manifest())
    mutate(d)
    with pytest.raises(rf.ManifestError):
        manifest_from_dict(d)


def test_bad_json_is_a_manifest_error() -> None:
    with pytest.raises(rf.ManifestError):
        decode(b"{not json")


def test_tile_digests_and_compile_target_roundtrip() -> None:
    spec = rf.ShardSpec(
        name="w", dtype="bfloat16", global_shape=(130, 4), axis=None, start=0, stop=130, digest="0" * 16, region=0,
        algo="mix64", tile_rows=64, tile_cols=4, blocks="A" * 32, compile_target="vllm_fused",
        compile_metadata=(("quant", "none"),),
    )  # fmt: skip
    assert spec.tiling.count == 3 and len(spec.digest_array()) == 3
    m = rf.Manifest(
        identity=rf.Identity(model="m"), version=1, rank=0, world_size=1,
        source=rf.SourceAddress(transport="loopback", agent="a"), shards=(spec,), metadata={"layout": "{}"},
    )  # fmt: skip
    back = manifest_from_dict(decode(encode(manifest_to_dict(m))))
    assert back == m and back.shards[0].algo == "mix64" and back.shards[0].tiling == spec.tiling
    with pytest.raises(rf.ManifestError, match="2 block digests for 3 blocks"):
        rf.ShardSpec(**{**_fields(spec), "blocks": "AAAAAAAAAAAAAAAAAAAAAA=="})  # 16 bytes


def _fields(spec: rf.ShardSpec) -> dict:
    return {f: getattr(spec, f) for f in rf.ShardSpec.__dataclass_fields__}


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"algo": "md5"}, "unknown digest algorithm 'md5'"),
        ({"tile_rows": 200}, "does not fit"),
        ({"tile_cols": 3, "tile_rows": 64}, "not whole 8-byte words"),  # 2 column ranges of 6 bytes
        ({"tile_rows": 0}, "tile_rows and blocks go together"),
        ({"blocks": "!!!!"}, "not base64"),
    ],
)
def test_impossible_digest_geometry_is_refused(change: dict, match: str) -> None:
    good = rf.ShardSpec(
        name="w", dtype="bfloat16", global_shape=(130, 4), axis=None, start=0, stop=130, digest="0" * 16, region=0,
        tile_rows=64, tile_cols=4, blocks="A" * 32,
    )  # fmt: skip
    with pytest.raises(rf.ManifestError, match=match):
        rf.ShardSpec(**{**_fields(good), **change})


def test_a_pending_manifest_carries_the_geometry_alone_and_its_digests_complete_it() -> None:
    """Two-phase publication: the same layout, first without digest values (revision ""), then with them."""
    full = _manifest()
    spec = full.shards[0]
    pending = dataclasses.replace(full, revision="", shards=(dataclasses.replace(spec, digest=""),))
    assert pending.pending and not full.pending and pending.revision == ""
    assert full.completes(pending) and not pending.completes(full) and not full.completes(full)
    back = manifest_from_dict(decode(encode(manifest_to_dict(pending))))
    assert back == pending and back.layout_digest == full.layout_digest
    with pytest.raises(rf.ManifestError, match="pending"):
        pending.shards[0].digest_bytes  # noqa: B018
    with pytest.raises(rf.ManifestError, match="a pending digest has no blocks"):
        dataclasses.replace(spec, digest="", blocks="AAAAAAAAAAA=")
    other = dataclasses.replace(full, shards=(dataclasses.replace(spec, region=spec.region + 1),))
    assert not other.completes(pending)  # the digests of another layout complete nothing


def test_a_manifest_half_pending_is_refused() -> None:
    a = rf.ShardSpec(name="a", dtype="uint8", global_shape=(4,), axis=None, start=0, stop=4, digest="0" * 16, region=0)
    b = dataclasses.replace(a, name="b", digest="")
    with pytest.raises(rf.ManifestError, match="all pending or none"):
        rf.Manifest(identity=rf.Identity(model="m"), version=1, rank=0, world_size=1,
                    source=rf.SourceAddress(transport="loopback", agent="x"), shards=(a, b))  # fmt: skip


@pytest.mark.parametrize("fmt", [None, 1, True, 2, 3, 3.0, "4"])
def test_a_manifest_of_another_format_is_refused_not_misread(fmt) -> None:
    d = manifest_to_dict(_manifest())
    if fmt is None:
        del d["format"]
        d["shards"] = [["w", "bfloat16", [8, 4], 0, 0, 4, "0123456789abcdef", 3, 0]]  # what format 1 sent
    else:
        d["format"] = fmt  # 2: digests were never pending; 3: rows, not columns
    with pytest.raises(rf.ManifestError, match=r"manifest format .* is not supported: this refitflow reads format 4"):
        manifest_from_dict(d)
