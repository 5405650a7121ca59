"""Manifests survive the wire; malformed ones are refused with ManifestError."""

from __future__ import annotations

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
        lambda d: d["shards"][0].__setitem__(1, "float7"),
        lambda d: d["shards"][0].__setitem__(5, 99),
        lambda d: d["shards"][0].__setitem__(6, ""),
        lambda d: d["shards"].append(list(d["shards"][0])),
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


def test_block_digests_and_compile_target_roundtrip() -> None:
    spec = rf.ShardSpec(
        name="w", dtype="bfloat16", global_shape=(130, 4), axis=None, start=0, stop=130, digest="0" * 16, region=0,
        block_rows=64, blocks="A" * 32, compile_target="vllm_fused", compile_metadata=(("quant", "none"),),
    )  # fmt: skip
    assert spec.block_count == 3 and spec.block_bytes == 64 * 4 * 2 and len(spec.block_digests()) == 3
    m = rf.Manifest(
        identity=rf.Identity(model="m"), version=1, rank=0, world_size=1,
        source=rf.SourceAddress(transport="loopback", agent="a"), shards=(spec,), metadata={"layout": "{}"},
    )  # fmt: skip
    assert manifest_from_dict(decode(encode(manifest_to_dict(m)))) == m
    with pytest.raises(rf.ManifestError, match="2 block digests for 3 blocks"):
        rf.ShardSpec(**{**spec.__dict__, "blocks": "AAAAAAAAAAAAAAAAAAAAAA=="})  # 16 bytes
