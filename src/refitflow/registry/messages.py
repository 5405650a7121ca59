"""The registry protocol's messages: orjson dicts carrying ``PROTOCOL_VERSION``, and typed errors.

Request (DEALER → ROUTER, one frame): ``{"v", "id", "op", "inc"?, "deadline"?, ...arguments}``.
Reply (one frame): ``{"v", "id", "inc", "now", "pub", "ok": true, "result"}`` or ``{"v", "id", "inc", "now",
"pub", "ok": false, "error", "message", "version", "tensor"}`` where ``error`` names a class of the refitflow
exception tree, ``inc`` the registry's incarnation (new at every start), ``now`` its clock and ``pub`` where
this process announces.
Announcement (PUB, two frames): topic ``b"complete|" + identity.key()``, then ``{"v", "identity", "version"}``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from refitflow.core import errors
from refitflow.core.errors import ManifestError, RefitError
from refitflow.core.types import Identity
from refitflow.core.wire import PROTOCOL_VERSION, decode, encode

__all__ = [
    "CLAIMED",
    "check_message",
    "decode_message",
    "error_from_reply",
    "error_reply",
    "identity_from_dict",
    "identity_to_dict",
    "ok_reply",
    "topic",
]

_IDENTITY_FIELDS = ("model", "layout", "dtype", "parallelism", "compile_target")
CLAIMED = "is published by another client whose lease lives"  # a VersionError's words: another client's rank
_ERRORS: dict[str, type[RefitError]] = {
    name: getattr(errors, name) for name in errors.__all__ if isinstance(getattr(errors, name), type)
}


def identity_to_dict(identity: Identity) -> dict[str, str]:
    return {name: getattr(identity, name) for name in _IDENTITY_FIELDS}


def identity_from_dict(d: Any) -> Identity:
    if not isinstance(d, dict) or not set(d) <= set(_IDENTITY_FIELDS) or "model" not in d:
        raise ManifestError(f"malformed identity {d!r:.80}")
    return Identity(**d)


def topic(identity: Identity) -> bytes:
    return b"complete|" + identity.key().encode()


def ok_reply(request_id: Any, result: Any, stamp: Mapping[str, Any]) -> bytes:
    """``stamp``: what the service adds to every reply (its incarnation and clock)."""
    return encode({"v": PROTOCOL_VERSION, "id": request_id, **stamp, "ok": True, "result": result})


def error_reply(request_id: Any, exc: BaseException, stamp: Mapping[str, Any]) -> bytes:
    if isinstance(exc, RefitError):
        name, message = type(exc).__name__, exc.reason
        version, tensor = exc.version, exc.tensor
    else:
        name, message, version, tensor = "RefitError", f"registry failed: {type(exc).__name__}: {exc}", None, None
    return encode({
        "v": PROTOCOL_VERSION, "id": request_id, **stamp, "ok": False, "error": name, "message": message,
        "version": version, "tensor": tensor,
    })  # fmt: skip


def error_from_reply(reply: dict[str, Any]) -> RefitError:
    cls = _ERRORS.get(str(reply.get("error")), RefitError)
    version, tensor = reply.get("version"), reply.get("tensor")
    v = version if isinstance(version, int) else None
    t = tensor if isinstance(tensor, str) else None
    try:
        return cls(f"registry refused: {reply.get('message')}", version=v, tensor=t)
    except TypeError:  # an error class with its own constructor (CoverageError)
        return RefitError(f"registry refused ({cls.__name__}): {reply.get('message')}", version=v, tensor=t)


def decode_message(frame: bytes) -> dict[str, Any]:
    return check_message(decode(frame))


def check_message(msg: Any) -> dict[str, Any]:
    """``msg`` if it is a message of our protocol, else ``ManifestError``."""
    if not isinstance(msg, dict):
        raise ManifestError(f"a message must be a JSON object, got {type(msg).__name__}")
    v = msg.get("v")
    if type(v) is not int or v != PROTOCOL_VERSION:  # not `true`, not `1.0`: they equal 1 in Python
        raise ManifestError(f"protocol version {msg.get('v')!r:.20} not supported (we speak {PROTOCOL_VERSION})")
    return msg
