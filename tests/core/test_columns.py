"""Shard specs as columns (wire format 4): the same specs back, and the same verdict as ``ShardSpec`` itself on
every malformed field — whether the field is shared by every shard (``same``) or listed (``each``)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import refitflow as rf
from refitflow.core.columns import FIELDS, KINDS, shards_from_columns, shards_to_columns

BLOCKS = "A" * 32  # 24 bytes: 3 digests (a 130 × 4 shard in tiles of 64 rows)


def _specs(n: int = 3) -> tuple[rf.ShardSpec, ...]:
    return tuple(
        rf.ShardSpec(name=f"layers.{i}.w", dtype="bfloat16", global_shape=(260, 4), axis=0, start=130, stop=260,
                     digest=f"{i:016x}", region=i, tile_rows=64, tile_cols=4, blocks=BLOCKS,
                     compile_target="vllm_fused" if i == 1 else "",
                     compile_metadata=(("quant", "none"),) if i == 1 else ())
        for i in range(n)
    )  # fmt: skip


def test_specs_survive_the_column_form_and_shared_fields_are_sent_once() -> None:
    specs = _specs()
    wire = shards_to_columns(specs)
    assert shards_from_columns(copy.deepcopy(wire)) == specs
    assert set(wire["same"]) == {"dtype", "global_shape", "axis", "start", "stop", "offset", "algo", "tile_rows",
                                 "tile_cols", "blocks"}  # fmt: skip
    assert wire["each"]["compile_metadata"] == [{}, {"quant": "none"}, {}]
    one = shards_to_columns(specs[:1])
    assert one["each"] == {} and "compile_target" not in one["same"] and shards_from_columns(one) == specs[:1]


BAD: dict[str, list[Any]] = {
    "name": ["", "../x", "a b", 3, None, "x" * 1025],
    "dtype": ["float7", 1, None],
    "global_shape": [[260], [260, -4], [260, 4, 1, 1, 1, 1, 1, 1, 1], [260, "4"], [260, True], "260", [2**40, 2**40]],
    "axis": [1, 2, -1, True, "0"],
    "start": [-1, 260, 300, 2**63, 1.5, False],
    "stop": [130, 261, 2**64, "260"],
    "digest": ["0" * 15, "0" * 15 + "g", "", 5],
    "region": [-1, 2**63, 1.0],
    "offset": [-1, 2**63, True],
    "algo": ["md5", None],
    "tile_rows": [0, 200, -1, 2**63],
    "tile_cols": [3, 0, 5],
    "blocks": ["", "A" * 31, "A" * 28 + "A===", "!" * 32, "A" * 36, 7],
    "compile_target": [3, None],
    "compile_metadata": [{"q": 3}, {"q": None}, [["q", "x"]], "q"],
}


def _single_verdict(fields: dict[str, Any]) -> bool:
    """Whether ``ShardSpec`` accepts these fields as the wire gives them (lists where it holds tuples)."""
    fields = dict(fields)
    try:
        fields["global_shape"] = tuple(fields["global_shape"])
        meta = fields["compile_metadata"]
        if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
            return False
        fields["compile_metadata"] = tuple(sorted(meta.items()))
        rf.ShardSpec(**fields)
    except (rf.ManifestError, TypeError, ValueError, AttributeError):
        return False
    return True


@pytest.mark.parametrize("where", ["same", "each"])
@pytest.mark.parametrize(("field", "value"), [(f, v) for f, vs in BAD.items() for v in vs])
def test_a_malformed_field_gets_the_verdict_a_single_spec_gives(field: str, value: Any, where: str) -> None:
    specs = _specs()
    wire = shards_to_columns(specs)
    row = {f: getattr(specs[2], f) for f in FIELDS} | {"compile_metadata": {}, "global_shape": [260, 4], field: value}
    if where == "same" and field != "name":
        wire["same"][field] = value
        wire["each"].pop(field, None)
    else:
        column = wire["each"].pop(field, None) or [wire["same"].pop(field, None)] * 3
        wire["each"][field] = [*column[:2], value]
    ok = _single_verdict(row) and (field != "digest" or value != "")  # "" beside digests: half pending
    ok = ok and type(value) in KINDS[field]  # the wire takes exact JSON types: a bool is no integer (as format 3)
    if ok:
        assert len(shards_from_columns(wire)) == 3
    else:
        with pytest.raises(rf.ManifestError):
            shards_from_columns(wire)


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d.pop("count"),
        lambda d: d.__setitem__("count", 0),
        lambda d: d.__setitem__("count", 4),
        lambda d: d.__setitem__("count", True),
        lambda d: d["same"].pop("dtype"),
        lambda d: d["each"].__setitem__("dtype", ["bfloat16"] * 3),  # in same and each
        lambda d: d["each"].__setitem__("colour", ["red"] * 3),
        lambda d: d["each"]["name"].pop(),
        lambda d: d["each"].__setitem__("name", ["a", "b", "a"]),
        lambda d: d.__setitem__("same", []),
    ],
)
def test_a_malformed_column_form_is_refused(mutate) -> None:
    wire = shards_to_columns(_specs())
    mutate(wire)
    with pytest.raises(rf.ManifestError):
        _manifest(wire)


def _manifest(wire: dict[str, Any]) -> rf.Manifest:
    return rf.Manifest(
        identity=rf.Identity(model="m"),
        version=1,
        rank=0,
        world_size=1,
        source=rf.SourceAddress(transport="loopback", agent="a"),
        shards=shards_from_columns(wire),
    )


junk = st.one_of(st.none(), st.booleans(), st.integers(-3, 2**64), st.text(max_size=5), st.floats(allow_nan=False),
                 st.lists(st.integers(-2, 300), max_size=3))  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(field=st.sampled_from(FIELDS), index=st.integers(0, 2), value=junk)
def test_any_value_in_any_field_gets_the_verdict_a_single_spec_gives(field: str, index: int, value: Any) -> None:
    specs = _specs()
    wire = shards_to_columns(specs)
    column = wire["each"].pop(field, None) or [wire["same"].pop(field, None)] * 3
    column = [{} if v is None and field == "compile_metadata" else v for v in column]
    column = ["" if v is None and field == "compile_target" else v for v in column]
    column[index] = value
    wire["each"][field] = column
    rows = [
        {f: getattr(s, f) for f in FIELDS}
        | {"compile_metadata": dict(s.compile_metadata), "global_shape": list(s.global_shape)}
        for s in specs
    ]
    rows[index][field] = value
    digests = {r["digest"] == "" for r in rows if isinstance(r["digest"], str)}
    names = [r["name"] for r in rows]
    exact = all(type(r[f]) in KINDS[f] for r in rows for f in FIELDS)
    ok = all(map(_single_verdict, rows)) and len(digests) == 1 and len(set(map(str, names))) == 3 and exact
    if ok:
        assert shards_from_columns(wire)[index] == rf.ShardSpec(
            **{
                **rows[index],
                "global_shape": tuple(rows[index]["global_shape"]),
                "compile_metadata": tuple(sorted(rows[index]["compile_metadata"].items())),
            }
        )
    else:
        with pytest.raises(rf.ManifestError):
            _manifest(wire)


def test_a_huge_count_of_shards_sharing_every_field_is_refused_at_once() -> None:
    wire = shards_to_columns(_specs(1))
    wire["count"] = 10**15  # every field in same: nothing but the count says how many
    with pytest.raises(rf.ManifestError, match="of one name"):
        shards_from_columns(wire)
