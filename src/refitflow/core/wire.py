"""Manifests to and from bytes (orjson). Anything malformed becomes a ``ManifestError``.

A manifest dict carries ``"format": PROTOCOL_VERSION``; one of another format (or none: format 1,
before per-shard digest algorithms and tiles) is refused, never read with the wrong meaning.
The shard specs are columns (``core/columns.py``): a field every shard shares is sent and checked once.
"""

from __future__ import annotations

import base64
from typing import Any

import orjson

from refitflow.core.columns import DIGESTS, completed_columns, shards_from_columns, shards_to_columns
from refitflow.core.errors import ManifestError, RefitError
from refitflow.core.fanout import HeldBox, RelayLayouts, RelayOffer, RelayParam, check_offer_shape
from refitflow.core.types import Identity, Manifest, SourceAddress

__all__ = [
    "PROTOCOL_VERSION",
    "UNKNOWN_LAYOUT",
    "decode",
    "digests_to_dict",
    "encode",
    "manifest_completed",
    "manifest_from_dict",
    "manifest_to_dict",
    "offer_from_dict",
    "offer_to_dict",
]  # fmt: skip

UNKNOWN_LAYOUT = "a layout this peer does not hold"  # a compact relay offer's refusal: send the whole offer
MAX_OFFER_TENSORS = 1 << 24  # the tensors of one relay offer, at most
PROTOCOL_VERSION = 4  # 2: per-shard digest algorithm (xxh3 | mix64) and 2-D tiles; 3: pending digests; 4: columns


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
    return {**_head(m), "shards": shards_to_columns(m.shards)}


def _head(m: Manifest) -> dict[str, Any]:
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
    }


def digests_to_dict(m: Manifest) -> dict[str, Any]:
    """The second message of two-phase publication: ``m``'s revision and digests alone (its layout went first)."""
    return {"format": PROTOCOL_VERSION, "revision": m.revision, "digests": shards_to_columns(m.shards, DIGESTS)}


def manifest_completed(pending: Manifest, d: Any) -> Manifest:
    """``pending`` (a manifest announced before its digests) with the digests of ``d`` (``digests_to_dict``),
    checked whole as ``manifest_from_dict`` checks a manifest."""
    if not isinstance(d, dict):
        raise ManifestError("digests: a JSON object")
    _check_format(d)
    return manifest_from_dict({**_head(pending), "revision": d.get("revision"),
                               "shards": completed_columns(pending.shards, d.get("digests"))})  # fmt: skip


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
        shards = shards_from_columns(d["shards"])
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


def offer_to_dict(o: RelayOffer, *, compact: bool = False) -> dict[str, Any]:
    """A relay offer (``core.relay``); held boxes are rows ``[rank, tensor, sbox, param, dbox]``, boxes flat.
    ``compact``: for a peer that knows its layout (``RelayLayouts``), the layout digest and the tensors' regions
    (as runs ``[first, count]`` of consecutive regions) instead of the tensors and the held boxes."""
    head = {
        "format": PROTOCOL_VERSION,
        "identity": _identity(o.identity),
        "version": o.version,
        "receiver": o.receiver,
        "source": _source(o.source),
        "status": o.status,
    }
    if compact:
        return {**head, "layout": o.layout, "regions": _runs([p.region for p in o.params])}
    return {**head, "params": [[p.name, p.dtype, list(p.shape), p.region] for p in o.params],
            "held": [[h.rank, h.tensor, _flat(h.sbox), h.param, _flat(h.dbox)] for h in o.held]}  # fmt: skip


def offer_from_dict(d: Any, layouts: RelayLayouts | None = None) -> RelayOffer:
    """Build and check a relay offer (a compact one from the geometry ``layouts`` holds: a ``ManifestError``
    saying ``UNKNOWN_LAYOUT`` when it holds none); anything malformed raises ``ManifestError``."""
    try:
        _check_format(d)
        if "layout" in d:
            layout = _typed(d["layout"], str)
            known = None if layouts is None else layouts.params(layout, _unruns(d["regions"]))
            if known is None:
                raise ManifestError(f"relay offer: {UNKNOWN_LAYOUT} ({layout:.32})")
            params, held = known
        else:
            layout = ""
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
            layout=layout,
        )
    except RefitError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ManifestError(f"malformed relay offer: {type(exc).__name__}: {exc}") from exc
    if not layout:  # a known layout's geometry was checked when it was recorded
        check_offer_shape(offer)
        if layouts is not None:
            layouts.add(offer)
    return offer


def _runs(values: list[int]) -> list[list[int]]:
    runs: list[list[int]] = []
    for v in values:
        if runs and runs[-1][0] + runs[-1][1] == v:
            runs[-1][1] += 1
        else:
            runs.append([v, 1])
    return runs


def _unruns(runs: Any) -> list[int]:
    if not isinstance(runs, list) or not all(isinstance(r, list) and len(r) == 2 for r in runs):
        raise ManifestError("relay offer: regions are runs [first, count]")
    if sum(_typed(n, int) for _, n in runs) > MAX_OFFER_TENSORS:
        raise ManifestError("relay offer: more regions than a relay offer may hold")
    return [_typed(first, int) + i for first, n in runs for i in range(n)]
