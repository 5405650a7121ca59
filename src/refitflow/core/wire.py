"""Manifests to and from bytes (orjson). Anything malformed becomes a ``ManifestError``.

A manifest dict carries ``"format": PROTOCOL_VERSION``; one of another format (or none: format 1,
before per-shard digest algorithms and tiles) is refused, never read with the wrong meaning.
A shard is a list: name, dtype, global shape, axis, start, stop, digest, region, offset, digest
algorithm, tile rows, tile columns, base64 digests [, compile target, compile metadata].
"""

from __future__ import annotations

import base64
from typing import Any

import orjson

from refitflow.core.errors import ManifestError, RefitError
from refitflow.core.relay import HeldBox, RelayOffer, RelayParam, check_offer_shape
from refitflow.core.types import Identity, Manifest, ShardSpec, SourceAddress

__all__ = [
    "PROTOCOL_VERSION", "decode", "encode", "manifest_from_dict", "manifest_to_dict", "offer_from_dict",
    "offer_to_dict",
]  # fmt: skip

PROTOCOL_VERSION = 3  # 2: per-shard digest algorithm (xxh3 | mix64) and 2-D tiles; 3: pending digests


def encode(obj: Any) -> bytes:
    return orjson.dumps(obj)


def decode(data: bytes) -> Any:
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise ManifestError(f"not valid JSON: {exc}") from exc


def _identity(i: Identity) -> dict[str, str]:
    return {"model": i.model, "layout": i.layout, "dtype": i.dtype, "parallelism": i.parallelism,
            "compile_target": i.compile_target}  # fmt: skip


def _source(s: SourceAddress) -> dict[str, str]:
    return {"transport": s.transport, "agent": s.agent, "metadata": base64.b64encode(s.metadata).decode()}


def _source_from(src: Any) -> SourceAddress:
    return SourceAddress(
        transport=_typed(src["transport"], str),
        agent=_typed(src["agent"], str),
        metadata=base64.b64decode(_typed(src.get("metadata", ""), str), validate=True),
    )


def manifest_to_dict(m: Manifest) -> dict[str, Any]:
    return {
        "format": PROTOCOL_VERSION,
        "identity": _identity(m.identity),
        "version": m.version,
        "rank": m.rank,
        "world_size": m.world_size,
        "revision": m.revision,
        "layout_digest": m.layout_digest,
        "metadata": m.metadata,
        "source": _source(m.source),
        "shards": [
            [
                s.name,
                s.dtype,
                list(s.global_shape),
                s.axis,
                s.start,
                s.stop,
                s.digest,
                s.region,
                s.offset,
                s.algo,
                s.tile_rows,
                s.tile_cols,
                s.blocks,
            ]
            + ([s.compile_target, dict(s.compile_metadata)] if s.compile_target else [])
            for s in m.shards
        ],
    }


def _check_format(d: Any) -> None:
    if type(d.get("format")) is not int or d["format"] != PROTOCOL_VERSION:
        raise ManifestError(
            f"manifest format {d.get('format', 1)!r:.20} is not supported: this refitflow reads format "
            f"{PROTOCOL_VERSION} (publisher and receiver must run compatible refitflow versions)"
        )


def manifest_from_dict(d: Any) -> Manifest:
    """Build and validate a manifest; every malformed field raises ``ManifestError``."""
    try:
        _check_format(d)
        shards = tuple(_shard(row) for row in d["shards"])
        return Manifest(
            identity=Identity(**{k: _typed(v, str) for k, v in d["identity"].items()}),
            version=_typed(d["version"], int),
            rank=_typed(d["rank"], int),
            world_size=_typed(d["world_size"], int),
            revision=_typed(d.get("revision", ""), str),
            layout_digest=_typed(d.get("layout_digest", ""), str),
            metadata={_typed(k, str): _typed(v, str) for k, v in d.get("metadata", {}).items()},
            source=_source_from(d["source"]),
            shards=shards,
        )
    except RefitError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ManifestError(f"malformed manifest: {type(exc).__name__}: {exc}") from exc


# the JSON types of a shard row's 13 fixed fields (axis: null or an integer); exact types, so a bool is no int
_ROW = (str, str, list, type(None), int, int, str, int, int, str, int, int, str)
_ROW_AXIS = (*_ROW[:3], int, *_ROW[4:])


def _shard(row: Any) -> ShardSpec:
    """One shard row: the common row (exact JSON types) checked in one pass, any other field by field (the
    error names the value)."""
    name, dtype, shape, axis, start, stop, digest, region, offset, algo, tile_rows, tile_cols, blocks, *rest = row
    types = tuple(map(type, row[:13]))
    if not ((types == _ROW or types == _ROW_AXIS) and set(map(type, shape)) <= {int}):
        axes = () if axis is None else ((axis, int),)
        for value, kind in ((name, str), (dtype, str), *((x, int) for x in shape), *axes, (start, int), (stop, int),
                            (digest, str), (region, int), (offset, int), (algo, str), (tile_rows, int),
                            (tile_cols, int), (blocks, str)):  # fmt: skip
            _typed(value, kind)
    return ShardSpec(
        name=name, dtype=dtype, global_shape=tuple(shape), axis=axis, start=start, stop=stop, digest=digest,
        region=region, offset=offset, algo=algo, tile_rows=tile_rows, tile_cols=tile_cols, blocks=blocks,
        compile_target=_typed(rest[0], str) if rest else "",
        compile_metadata=tuple(sorted((_typed(k, str), _typed(v, str)) for k, v in rest[1].items()))
        if len(rest) > 1
        else (),
    )  # fmt: skip


def _typed(value: Any, kind: type) -> Any:
    if (kind is int and isinstance(value, bool)) or not isinstance(value, kind):
        raise ManifestError(f"expected {kind.__name__}, got {type(value).__name__} {value!r:.60}")
    return value


def _flat(box: tuple[tuple[int, int], ...]) -> list[int]:
    return [x for ab in box for x in ab]


def _unflat(v: Any) -> tuple[tuple[int, int], ...]:
    if not isinstance(v, list) or len(v) % 2:
        raise ManifestError(f"a box is an even-length list of integers, got {v!r:.60}")
    xs = [_typed(x, int) for x in v]
    return tuple(zip(xs[::2], xs[1::2], strict=True))


def offer_to_dict(o: RelayOffer) -> dict[str, Any]:
    """A relay offer (``core.relay``); held boxes are rows ``[rank, tensor, sbox, param, dbox]``, boxes flat."""
    return {
        "format": PROTOCOL_VERSION,
        "identity": _identity(o.identity),
        "version": o.version,
        "receiver": o.receiver,
        "source": _source(o.source),
        "status": o.status,
        "params": [[p.name, p.dtype, list(p.shape), p.region] for p in o.params],
        "held": [[h.rank, h.tensor, _flat(h.sbox), h.param, _flat(h.dbox)] for h in o.held],
    }


def offer_from_dict(d: Any) -> RelayOffer:
    """Build and check a relay offer; anything malformed raises ``ManifestError``."""
    try:
        _check_format(d)
        params = tuple(
            RelayParam(_typed(n, str), _typed(t, str), tuple(_typed(x, int) for x in s), _typed(r, int))
            for n, t, s, r in d["params"]
        )
        held = tuple(
            HeldBox(_typed(r, int), _typed(n, str), _unflat(sb), _typed(p, int), _unflat(db))
            for r, n, sb, p, db in d["held"]
        )
        offer = RelayOffer(
            identity=Identity(**{k: _typed(v, str) for k, v in d["identity"].items()}),
            version=_typed(d["version"], int),
            receiver=_typed(d["receiver"], str),
            source=_source_from(d["source"]),
            status=_typed(d["status"], int),
            params=params,
            held=held,
        )
    except RefitError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ManifestError(f"malformed relay offer: {type(exc).__name__}: {exc}") from exc
    check_offer_shape(offer)
    return offer
