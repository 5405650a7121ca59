"""Manifests to and from bytes (orjson). Anything malformed becomes a ``ManifestError``.

A manifest dict carries ``"format": PROTOCOL_VERSION``; one of another format (or none: format 1,
before per-shard digest algorithms and tiles) is refused, never read with the wrong meaning.
The shard specs are columns (``core/columns.py``): a field every shard shares is sent and checked once.

**Bytes beside the JSON** (added to format 4: a peer that does not know them refuses the frame as not JSON). A
value may be a ``Blob``: raw bytes (digests), not base64 text. ``encode`` writes the JSON with each blob as a
reference ``{"\u0000": [offset, length]}``, then a NUL byte (JSON text never holds a raw one), then the blobs back
to back; ``decode`` splits at the first NUL, decodes the JSON and puts each blob's bytes (a ``memoryview``) where
its reference was — references must cover the bytes after the NUL exactly, in order, or the message is refused.
A message without blobs is plain JSON, as before.
"""

from __future__ import annotations

import base64
from typing import Any

import orjson

from refitflow.core.columns import DIGESTS, completed_columns, shards_from_columns, shards_to_columns
from refitflow.core.errors import ManifestError, RefitError
from refitflow.core.types import Identity, Manifest, SourceAddress

__all__ = [
    "PROTOCOL_VERSION",
    "UNKNOWN_LAYOUT",
    "Blob",
    "check_format",
    "decode",
    "digests_to_dict",
    "encode",
    "identity_dict",
    "manifest_completed",
    "manifest_from_dict",
    "manifest_to_dict",
    "source_dict",
    "source_from",
    "split_frame",
    "with_blobs",
]  # fmt: skip

UNKNOWN_LAYOUT = "a layout this peer does not hold"  # a compact form's refusal: send the whole
PROTOCOL_VERSION = 4  # 2: per-shard digest algorithm and 2-D tiles; 3: pending digests; 4: columns (and, added to
# it without changing what a whole manifest means: rank layouts and records, blobs beside the JSON, parts)
BLOB = "\u0000"  # the key of a blob's reference in the JSON


class Blob(dict[str, int]):
    """Raw bytes a message carries beside its JSON (``encode``). As a dict it is ``{"bytes": n}``: what plain JSON
    tools (and a request spy) see of it."""

    __slots__ = ("data",)

    def __init__(self, data: bytes | bytearray | memoryview) -> None:
        super().__init__(bytes=len(data))
        self.data = data


def encode(obj: Any) -> bytes:
    blobs: list[bytes | bytearray | memoryview] = []
    at = [0]

    def hook(value: Any) -> Any:
        if isinstance(value, Blob):
            ref = {BLOB: [at[0], len(value.data)]}
            blobs.append(value.data)
            at[0] += len(value.data)
            return ref
        if isinstance(value, dict):  # other subclasses of the JSON types, as their type
            return dict(value)
        if isinstance(value, list):
            return list(value)
        if isinstance(value, str):
            return str(value)
        if isinstance(value, int):
            return int(value)
        raise TypeError(f"{type(value).__name__} is not JSON")

    head = orjson.dumps(obj, default=hook, option=orjson.OPT_PASSTHROUGH_SUBCLASS)
    return b"".join([head, b"\0", *blobs]) if blobs else head


def split_frame(data: bytes | memoryview) -> tuple[bytes | memoryview, memoryview | None]:
    """A message's JSON and the bytes after its NUL (None: plain JSON)."""
    at = data.find(b"\0") if isinstance(data, bytes) else bytes(data).find(b"\0")
    if at < 0:
        return data, None
    view = memoryview(data)
    return view[:at], view[at + 1 :]


def decode(data: bytes | memoryview) -> Any:
    head, tail = split_frame(data)
    try:
        doc = orjson.loads(head)
    except orjson.JSONDecodeError as exc:
        raise ManifestError(f"not valid JSON: {exc}") from exc
    return doc if tail is None else with_blobs(doc, tail)


def with_blobs(doc: Any, tail: memoryview) -> Any:
    """``doc`` with each blob reference replaced by its bytes of ``tail``; the references must cover ``tail``
    exactly, in order (``ManifestError`` otherwise)."""
    at = [0]

    def walk(value: Any) -> Any:
        if isinstance(value, dict):
            if len(value) == 1 and BLOB in value:
                ref = value[BLOB]
                if not (isinstance(ref, list) and len(ref) == 2 and all(type(x) is int for x in ref)):
                    raise ManifestError("a blob reference is [offset, length]")
                offset, length = ref
                if offset != at[0] or length < 0 or offset + length > len(tail):
                    raise ManifestError(f"a blob reference [{offset}, {length}] does not follow the one before "
                                        f"within the message's {len(tail)} bytes")  # fmt: skip
                at[0] += length
                return tail[offset : offset + length]
            return {k: walk(v) for k, v in value.items()}
        if isinstance(value, list):
            return [walk(v) for v in value]
        return value

    try:
        out = walk(doc)
    except RecursionError:
        raise ManifestError("a message with bytes beside it is nested too deeply") from None
    if at[0] != len(tail):
        raise ManifestError(f"{len(tail) - at[0]} bytes after the message's JSON that no blob reference names")
    return out


def identity_dict(i: Identity) -> dict[str, str]:
    return {"model": i.model, "layout": i.layout, "dtype": i.dtype, "parallelism": i.parallelism,
            "compile_target": i.compile_target}  # fmt: skip


def source_dict(s: SourceAddress) -> dict[str, str]:
    return {"transport": s.transport, "agent": s.agent, "metadata": base64.b64encode(s.metadata).decode()}


def source_from(src: Any) -> SourceAddress:
    return SourceAddress(
        transport=typed(src["transport"], str),
        agent=typed(src["agent"], str),
        metadata=base64.b64decode(typed(src.get("metadata", ""), str), validate=True),
    )


def manifest_to_dict(m: Manifest) -> dict[str, Any]:
    return {**_head(m), "shards": shards_to_columns(m.shards)}


def _head(m: Manifest) -> dict[str, Any]:
    return {
        "format": PROTOCOL_VERSION,
        "identity": identity_dict(m.identity),
        "version": m.version,
        "rank": m.rank,
        "world_size": m.world_size,
        "revision": m.revision,
        "layout_digest": m.layout_digest,
        "metadata": m.metadata,
        "source": source_dict(m.source),
    }


def digests_to_dict(m: Manifest) -> dict[str, Any]:
    """The second message of two-phase publication: ``m``'s revision and digests alone (its layout went first)."""
    return {"format": PROTOCOL_VERSION, "revision": m.revision, "digests": shards_to_columns(m.shards, DIGESTS)}


def manifest_completed(pending: Manifest, d: Any) -> Manifest:
    """``pending`` (a manifest announced before its digests) with the digests of ``d`` (``digests_to_dict``),
    checked whole as ``manifest_from_dict`` checks a manifest."""
    if not isinstance(d, dict):
        raise ManifestError("digests: a JSON object")
    check_format(d)
    return manifest_from_dict({**_head(pending), "revision": d.get("revision"),
                               "shards": completed_columns(pending.shards, d.get("digests"))})  # fmt: skip


def check_format(d: Any) -> None:
    if type(d.get("format")) is not int or d["format"] != PROTOCOL_VERSION:
        raise ManifestError(
            f"manifest format {d.get('format', 1)!r:.20} is not supported: this refitflow reads format "
            f"{PROTOCOL_VERSION} (publisher and receiver must run compatible refitflow versions)"
        )


def manifest_from_dict(d: Any) -> Manifest:
    """Build and validate a manifest; every malformed field raises ``ManifestError``."""
    try:
        check_format(d)
        shards = shards_from_columns(d["shards"])
        return Manifest(
            identity=Identity(**{k: typed(v, str) for k, v in d["identity"].items()}),
            version=typed(d["version"], int),
            rank=typed(d["rank"], int),
            world_size=typed(d["world_size"], int),
            revision=typed(d.get("revision", ""), str),
            layout_digest=typed(d.get("layout_digest", ""), str),
            metadata={typed(k, str): typed(v, str) for k, v in d.get("metadata", {}).items()},
            source=source_from(d["source"]),
            shards=shards,
        )
    except RefitError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ManifestError(f"malformed manifest: {type(exc).__name__}: {exc}") from exc


def typed(value: Any, kind: type) -> Any:
    if (kind is int and isinstance(value, bool)) or not isinstance(value, kind):
        raise ManifestError(f"expected {kind.__name__}, got {type(value).__name__} {value!r:.60}")
    return value
