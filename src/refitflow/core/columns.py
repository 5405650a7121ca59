"""A manifest's shard specs as columns (wire format 4), checked a column at a time.

On the wire the specs are ``{"count": n, "same": {field: value}, "each": {field: [n values]}}``: a field
every shard shares (a dtype, a shape, a digest geometry, the trainer rank's row range) is sent and checked
once, the others as one list each. Every field is in ``same`` or ``each``, never both (the compile fields
may be left out: none). The checks are those of ``ShardSpec`` — names, dtypes, shapes, ranges, digest
geometry and lengths, limits — run per column and per distinct geometry rather than per shard; where one
fails, the shards are built with ``ShardSpec`` itself until one raises, so the error is the one a single
spec gives. ``tests/core/test_columns.py`` holds the two to the same verdict on every field.
"""

from __future__ import annotations

import binascii
import dataclasses
import operator
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from itertools import repeat
from typing import Any

from refitflow.core.digests import ALGORITHMS
from refitflow.core.dtypes import itemsize, known_names
from refitflow.core.errors import ManifestError
from refitflow.core.types import MAX_DIMS, MAX_ELEMENTS, MAX_INT, ShardSpec, shard_tiling

__all__ = ["DIGESTS", "FIELDS", "KINDS", "completed_columns", "shards_from_columns", "shards_to_columns", "specs_of",
           "specs_of_columns"]  # fmt: skip

FIELDS = ("name", "dtype", "global_shape", "axis", "start", "stop", "digest", "region", "offset", "algo",
          "tile_rows", "tile_cols", "blocks", "compile_target", "compile_metadata")  # fmt: skip
_DEFAULTS = {"compile_target": "", "compile_metadata": {}}  # left out of the wire when no shard has any
_SPEC_DEFAULTS = {  # a spec's fields and their defaults (None: required)
    f.name: None if f.default is dataclasses.MISSING else f.default for f in dataclasses.fields(ShardSpec)
}
KINDS: dict[str, tuple[type, ...]] = {
    "name": (str,), "dtype": (str,), "global_shape": (list, tuple), "axis": (int, type(None)), "start": (int,),
    "stop": (int,), "digest": (str,), "region": (int,), "offset": (int,), "algo": (str,), "tile_rows": (int,),
    "tile_cols": (int,), "blocks": (str,), "compile_target": (str,), "compile_metadata": (dict, tuple),
}  # fmt: skip
_WIRE = {"global_shape": list, "compile_metadata": dict}
DIGESTS = ("digest", "blocks")  # what the second message of two-phase publication carries
_NAMES = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:-]{0,1023}(?:\n[A-Za-z0-9_][A-Za-z0-9_.:-]{0,1023})*")
_HEX = re.compile(r"[0-9a-fA-F]*")
_INTS = ("start", "stop", "region", "offset", "tile_rows", "tile_cols")
_GEOMETRY = ("global_shape", "axis", "start", "stop", "dtype", "algo", "tile_rows", "tile_cols")


def shards_to_columns(shards: Iterable[ShardSpec], fields: tuple[str, ...] = FIELDS) -> dict[str, Any]:
    """The wire form of ``shards`` (of ``fields`` alone: a digests-only completion sends two)."""
    rows = list(map(operator.attrgetter(*fields), shards))
    columns = zip(fields, zip(*rows, strict=True) if len(fields) > 1 else (rows,), strict=True)
    # as JSON carries them: a shape a list, compile metadata an object
    wire = {name: tuple(map(_WIRE[name], c)) if name in _WIRE else c for name, c in columns}
    return _split(wire, len(rows), _DEFAULTS)


def _split(columns: Mapping[str, Sequence[Any]], count: int, defaults: Mapping[str, Any]) -> dict[str, Any]:
    """The column form: a column of one value once in ``same`` (left out where it is its ``defaults`` entry),
    any other whole in ``each``."""
    same: dict[str, Any] = {}
    each: dict[str, Any] = {}
    for name, column in columns.items():
        first = column[0] if column else None
        if column and column.count(first) == len(column):  # (C speed: every value equal to the first)
            if defaults.get(name, ...) != first:
                same[name] = first
        else:
            each[name] = list(column)
    return {"count": count, "same": same, "each": each}


def specs_of(rows: Iterable[Mapping[str, Any]]) -> tuple[ShardSpec, ...]:
    """``ShardSpec``s of field mappings (a publisher's: absent fields take their defaults), checked as the wire
    form is — a column at a time, ≈ 1–2 µs a spec where one ``ShardSpec(...)`` each takes 5–10."""
    rows = list(rows)
    return specs_of_columns({f: [r.get(f, default) for r in rows] for f, default in _SPEC_DEFAULTS.items()})


def specs_of_columns(columns: Mapping[str, Sequence[Any]]) -> tuple[ShardSpec, ...]:
    """``specs_of`` for fields given as columns of equal length (absent ones take their defaults)."""
    n = len(columns["name"])
    full = {f: columns[f] if f in columns else [default] * n for f, default in _SPEC_DEFAULTS.items()}
    return shards_from_columns(_split(full, n, {}))


def completed_columns(pending: tuple[ShardSpec, ...], digests: Any) -> dict[str, Any]:
    """The wire form of ``pending``'s shards with the digest and blocks of ``digests`` (a wire form of those
    two fields alone, for as many shards): what ``shards_from_columns`` then checks whole."""
    if not isinstance(digests, dict) or set(digests) != {"count", "same", "each"} or digests["count"] != len(pending):
        raise ManifestError(f"digests: an object of count ({len(pending)}), same and each")
    given = {**digests["same"], **digests["each"]} if isinstance(digests["same"], dict) and isinstance(
        digests["each"], dict) else {}  # fmt: skip
    if set(given) != set(DIGESTS) or set(digests["same"]) & set(digests["each"]):
        raise ManifestError(f"digests: {DIGESTS} once each, in same or in each")
    wire = shards_to_columns(pending, tuple(f for f in FIELDS if f not in DIGESTS))
    wire["same"] |= digests["same"]
    wire["each"] |= digests["each"]
    return wire


class _Columns:
    """The wire form's columns: ``distinct(f)`` to check a field, ``values(f)`` (n of them) to build shards."""

    def __init__(self, d: Any) -> None:
        if not isinstance(d, dict) or set(d) != {"count", "same", "each"}:
            raise ManifestError("shards: an object of count, same and each")
        n, same, each = d["count"], d["same"], d["each"]
        if type(n) is not int or not isinstance(same, dict) or not isinstance(each, dict):
            raise ManifestError("shards: count is an integer, same and each are objects")
        if not 1 <= n <= MAX_INT:
            raise ManifestError(f"a manifest announces at least one shard, got a count of {n}")
        given = set(same) | set(each)
        if set(same) & set(each) or not set(FIELDS) - set(_DEFAULTS) <= given <= set(FIELDS):
            raise ManifestError(f"shards: each of {FIELDS} once, in same or in each")
        if any(not isinstance(v, list) or len(v) != n for v in each.values()):
            raise ManifestError(f"shards: every column in each holds {n} values")
        if n > 1 and "name" not in each:  # (a count alone must not make work: nothing else bounds it)
            raise ManifestError(f"shards: {n} shards of one name")
        self.n, self.same, self.each = n, {**{k: v for k, v in _DEFAULTS.items() if k not in given}, **same}, each

    def distinct(self, name: str) -> list[Any]:
        return [self.same[name]] if name in self.same else self.each[name]

    def values(self, name: str) -> Iterator[Any] | list[Any]:
        return repeat(self.same[name], self.n) if name in self.same else self.each[name]

    def rows(self) -> Iterator[dict[str, Any]]:
        return (dict(zip(FIELDS, row, strict=True)) for row in zip(*(self.values(f) for f in FIELDS), strict=True))


def shards_from_columns(d: Any) -> tuple[ShardSpec, ...]:
    """The checked specs of a wire form; anything malformed raises ``ManifestError`` (naming the shard)."""
    c = _Columns(d)
    try:
        return _checked(c)
    except (ManifestError, TypeError, ValueError, binascii.Error):
        _blame(c)  # raises the error of the first bad shard
        raise


def _checked(c: _Columns) -> tuple[ShardSpec, ...]:
    """The specs, when every check passes; else an exception (``_blame`` then names the shard)."""
    for name, kinds in KINDS.items():
        if not set(map(type, c.distinct(name))) <= set(kinds):
            raise ManifestError(f"shards: {name} of the wrong type")
    if ("name" in c.same and c.n > 1) or not _NAMES.fullmatch("\n".join(c.distinct("name"))):
        raise ManifestError("shards: a tensor name not allowed, or repeated")
    if not set(c.distinct("dtype")) <= known_names() or not set(c.distinct("algo")) <= set(ALGORITHMS):
        raise ManifestError("shards: an unknown dtype or digest algorithm")
    for name in _INTS:
        values = c.distinct(name)
        if max(values) > MAX_INT or (name in ("region", "offset") and min(values) < 0):
            raise ManifestError(f"shards: {name} out of range")
    shapes = {tuple(s) for s in c.distinct("global_shape")}
    for shape in shapes:
        _shape(shape)
    digests = c.distinct("digest")
    lengths = set(map(len, digests))
    if not lengths <= {0, 16} or len(lengths) > 1 or not _HEX.fullmatch("".join(digests)):
        raise ManifestError("shards: digests are 16 hexadecimal digits, all of them or none (pending)")
    for name in ("global_shape", "compile_metadata"):  # hashable, as ShardSpec holds them
        if name in c.same:
            c.same[name] = _frozen(name, c.same[name])
        else:
            c.each[name] = [_frozen(name, v) for v in c.each[name]]
    if any(f in c.each for f in _GEOMETRY):
        keys = list(zip(*(c.values(f) for f in _GEOMETRY), strict=True))
    else:  # one geometry for every shard: checked once
        keys = [tuple(c.same[f] for f in _GEOMETRY)]
    counts = {k: _geometry(*k) for k in set(keys)}
    if lengths == {0}:  # pending: the geometry alone
        if any(c.distinct("blocks")):
            raise ManifestError("shards: a pending digest has no blocks")
    else:  # tile_rows 0: no blocks (the one digest); else 8 bytes a block
        sizes = [len(binascii.a2b_base64(b, strict_mode=True)) if b else 0 for b in c.distinct("blocks")]
        want = [8 * counts[k] if k[6] else 0 for k in keys]
        if sizes != want and not (len(set(sizes)) == 1 and set(want) == set(sizes)):
            raise ManifestError("shards: tile_rows and blocks go together, one 8-byte digest per block")
    return _build(c)


def _frozen(name: str, value: Any) -> Any:
    if name == "global_shape":
        return tuple(value)
    if isinstance(value, tuple):  # a spec's own form (``specs_of``): pairs
        if not all(isinstance(kv, tuple) and len(kv) == 2 for kv in value):
            raise ManifestError("shards: compile metadata maps strings to strings")
        value = dict(value)
    if not all(type(k) is str and type(v) is str for k, v in value.items()):
        raise ManifestError("shards: compile metadata maps strings to strings")
    return tuple(sorted(value.items()))


def _shape(shape: tuple[Any, ...]) -> None:
    total = 1
    if len(shape) > MAX_DIMS or not set(map(type, shape)) <= {int}:
        raise ManifestError(f"shards: a bad shape {shape!r:.80}")
    for d in shape:
        if not 0 <= d <= MAX_ELEMENTS:
            raise ManifestError(f"shards: a bad shape {shape!r:.80}")
        total *= d
    if total > MAX_ELEMENTS:
        raise ManifestError(f"shards: a shape of more than {MAX_ELEMENTS} elements")


def _geometry(shape: tuple[int, ...], axis: int | None, start: int, stop: int, dtype: str, algo: str,
              tile_rows: int, tile_cols: int) -> int:  # fmt: skip
    """How many digests a shard of this geometry has (its range and tiles checked)."""
    if axis is None:
        if (start, stop) != (0, shape[0] if shape else 1):
            raise ManifestError("shards: an unsharded spec covers [0, dim0)")
        local = shape
    else:
        if not (0 <= axis < len(shape) and 0 <= start < stop <= shape[axis]):
            raise ManifestError("shards: a shard range outside its shape")
        local = (*shape[:axis], stop - start, *shape[axis + 1 :])
    return shard_tiling(algo, local, itemsize(dtype), tile_rows, tile_cols).count


def _build(c: _Columns) -> tuple[ShardSpec, ...]:
    """``ShardSpec``s of checked columns, not checked again one by one (≈ 0.6 µs a spec): the fields all
    shards share copied from one dict, the others set."""
    new, setattr_ = object.__new__, object.__setattr__
    copy = {f: c.same[f] for f in FIELDS if f in c.same}.copy
    each = [f for f in FIELDS if f not in c.same]
    out = []
    # zip(strict=True) costs a third of this loop; the columns' lengths were checked on the way in
    for row in zip(*(c.each[f] for f in each)) if each else repeat((), c.n):  # noqa: B905
        fields = copy()
        fields.update(zip(each, row))  # noqa: B905
        spec = new(ShardSpec)
        setattr_(spec, "__dict__", fields)
        out.append(spec)
    return tuple(out)


def _blame(c: _Columns) -> None:
    """Build each shard with ``ShardSpec`` until one raises its own ``ManifestError``."""
    for fields in c.rows():
        try:
            fields["global_shape"] = tuple(fields["global_shape"])
            if isinstance(fields["compile_metadata"], dict):
                fields["compile_metadata"] = _frozen("compile_metadata", fields["compile_metadata"])
            ShardSpec(**fields)
        except ManifestError:
            raise
        except (TypeError, ValueError, AttributeError) as exc:
            raise ManifestError(f"malformed shard: {type(exc).__name__}: {exc}",
                                tensor=str(fields["name"])[:80]) from None  # fmt: skip
    raise ManifestError("shards: malformed (no one shard is: a name repeated, or pending digests mixed)")
