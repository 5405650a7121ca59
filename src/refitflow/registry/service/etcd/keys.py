"""Where the registry's state lies in etcd, and how a large value is split below etcd's request limit.

Under ``/refitflow/<namespace>/``:

=================================  ==================================================  ====================
key                                value                                               lease
=================================  ==================================================  ====================
``inc``                            the store's incarnation (made once)                 none
``o/<owner>``                      the owner's lease id                                the owner's
``l/<layout id>``                  a rank's layout (``core.records``), written once    none (the janitor's)
``l/<layout id>/c/…``              the chunks of a large layout                        none
``m/<id>/<version>``               the version's key: identity, version; every         none
                                   state change of the version sets it (compare-and-set)
``m/<id>/<version>/r<rank>``       that rank's record: layout id, revision, digests    the publisher's
                                   (raw, beside the JSON), or the head of its chunks
``m/<id>/<version>/r<rank>/c/…``   the chunks of a large record                        the publisher's
``c/<id>/<rank>``                  the client publishing that rank (one per rank)      the publisher's
``r/<id>/<receiver>``              identity, the newest version the receiver is done   the receiver's
``x/<id>/<receiver>``              its relay join by geometry: version, layout,        the receiver's
                                   address id, status, region runs (the geometry and
                                   the address whole, the first time: or chunks)
=================================  ==================================================  ====================

``<id>`` is a hash of the identity (the value carries the identity itself); versions and ranks are fixed
width, so a version's keys are one prefix (deleted with one request) and sort in order.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from refitflow.core.errors import ConfigError, ManifestError
from refitflow.core.types import Identity
from refitflow.core.wire import decode, encode

__all__ = ["CHUNK_BYTES", "EtcdTLS", "Keys", "blob_value", "endpoints_of", "id_hash"]

CHUNK_BYTES = 1 << 20  # etcd refuses a request over 1.5 MiB (its default --max-request-bytes)


@dataclass(frozen=True, kw_only=True)
class EtcdTLS:
    """TLS to etcd (as etcd's ``--trusted-ca-file``/``--client-cert-auth`` want): the CA that signed the
    members' certificates, and this replica's client certificate and key (both, or neither)."""

    ca_file: Path
    cert_file: Path | None = None
    key_file: Path | None = None

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise ConfigError("an etcd client certificate and its key go together")
        for path in (self.ca_file, self.cert_file, self.key_file):
            if path is not None and not Path(path).is_file():
                raise ConfigError(f"etcd TLS file {path} does not exist")


def endpoints_of(url: str) -> list[str]:
    """``etcd://h1:2379,h2:2379`` → ``["h1:2379", "h2:2379"]`` (a bare ``h:p,…`` list too)."""
    if "://" in url and not url.startswith("etcd://"):
        raise ConfigError(f"an etcd store is etcd://host:port,host:port,…, got {url!r}")
    rest = url.removeprefix("etcd://").strip("/")
    found = [e.strip() for e in rest.split(",") if e.strip()]
    for e in found:
        host, _, port = e.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(f"an etcd endpoint is host:port, got {e!r} in {url!r}")
    if not found:
        raise ConfigError(f"no etcd endpoint in {url!r} (etcd://host:2379,host:2379,…)")
    return found


def id_hash(identity: Identity) -> str:
    return xxhash.xxh64_hexdigest(identity.key().encode())


class Keys:
    def __init__(self, namespace: str) -> None:
        if not namespace or "/" in namespace:
            raise ManifestError(f"an etcd namespace is a non-empty name without '/', got {namespace!r}")
        self.root = f"/refitflow/{namespace}/".encode()

    def incarnation(self) -> bytes:
        return self.root + b"inc"

    def owner(self, owner: str) -> bytes:
        return self.root + b"o/" + owner.encode()

    def version(self, identity: Identity, version: int) -> bytes:
        return self.root + f"m/{id_hash(identity)}/{version:020d}".encode()

    def layout(self, layout_id: str) -> bytes:
        return self.root + b"l/" + layout_id.encode()

    def manifest(self, identity: Identity, version: int, rank: int) -> bytes:
        return self.version(identity, version) + f"/r{rank:06d}".encode()

    def claim(self, identity: Identity, rank: int) -> bytes:
        return self.root + f"c/{id_hash(identity)}/{rank:06d}".encode()

    def receiver(self, identity: Identity, receiver_id: str) -> bytes:
        return self.root + f"r/{id_hash(identity)}/".encode() + receiver_id.encode()

    def relay(self, identity: Identity, receiver_id: str) -> bytes:
        return self.root + f"x/{id_hash(identity)}/".encode() + receiver_id.encode()

    def parse(self, key: bytes) -> tuple[str, list[str]]:
        """(kind, parts): ``("m", [id, version])``, ``("m", [id, version, "r000001"])``, ``("chunk", …)``, …"""
        rest = key[len(self.root) :].decode()
        kind, _, tail = rest.partition("/")
        parts = tail.split("/")
        if kind == "m" and len(parts) > 3:
            return "chunk", parts
        if kind == "x" and len(parts) > 2:  # x/<id>/<receiver>/c/…
            return "chunk", parts
        if kind == "l" and len(parts) > 1:  # l/<layout id>/c/…
            return "chunk", parts
        return kind, parts


def blob_value(key: bytes, doc: dict[str, Any]) -> tuple[bytes, list[tuple[bytes, bytes]]]:
    """``doc`` as the value of ``key``: inline when small, else a head naming its chunks (written first)."""
    data = encode(doc)
    if len(data) <= CHUNK_BYTES:
        return data, []
    nonce = uuid.uuid4().hex[:12]
    chunks = [(key + f"/c/{nonce}/{i:06d}".encode(), data[at : at + CHUNK_BYTES])
              for i, at in enumerate(range(0, len(data), CHUNK_BYTES))]  # fmt: skip
    head = encode({"chunks": len(chunks), "prefix": (key + f"/c/{nonce}/".encode()).decode(),
                   "bytes": len(data), "xxh": xxhash.xxh64_hexdigest(data)})  # fmt: skip
    return head, chunks


def chunked(value: dict[str, Any]) -> bool:
    return "chunks" in value and "prefix" in value


def join_chunks(head: dict[str, Any], values: list[bytes]) -> Any:
    data = b"".join(values)
    if len(values) != head["chunks"] or len(data) != head["bytes"] or xxhash.xxh64_hexdigest(data) != head["xxh"]:
        raise ManifestError(f"the chunks of {head['prefix']} do not add up to their head")
    return decode(data)
