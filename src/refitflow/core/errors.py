"""The one exception tree of refitflow.

Every error refitflow raises on purpose derives from :class:`RefitError`. Library errors (torch,
NIXL, ZMQ, the OS) are translated at the boundary where they happen and chained ``from exc``.
Errors carry ``version`` and ``tensor`` where they apply::

    RefitError                  root; .version, .tensor
    ├── ConfigError             a config object or argument that makes no sense (ValueError too)
    ├── PlanError               the publication cannot be mapped onto this rank: unknown dtype,
    │                           shape mismatch, a name the model doesn't have, overlapping shards;
    │                           always raised before any byte is written
    ├── CoverageError           a destination parameter not written exactly once (.missing,
    │                           .duplicated list the names)
    ├── IntegrityError          pulled bytes do not match the publisher's digest
    ├── TransportError          a read, registration or peer failed (dead peer, bad region)
    │   └── OutOfStepError      this rank can no longer follow a push stream: it tore down its
    │                           end of the stream's process group (rebuild the group)
    ├── VersionError            version did not increase, a transaction is already open, or a
    │                           republish with other content
    ├── FencedError             the rank is not serving a complete version (fence not ready)
    ├── ManifestError           a malformed manifest or message (ValueError too)
    │   └── FrameError          a push-stream frame refused (.kind: header, metadata, entry, ...)
    ├── AuthenticationError     a peer refused our CURVE keys (or we its): the key files do not match
    │   └── RoleError           the key was admitted, but its role may not do this (a rollout key publishing)
    └── RefitTimeoutError       a deadline passed (TimeoutError too)
"""

from __future__ import annotations

__all__ = [
    "RELEASED_HINT",
    "AlreadyCommittedError",
    "AuthenticationError",
    "ConfigError",
    "CoverageError",
    "FencedError",
    "FrameError",
    "IntegrityError",
    "ManifestError",
    "OutOfStepError",
    "PlanError",
    "RefitError",
    "RefitTimeoutError",
    "RoleError",
    "TransportError",
    "VersionError",
]


# what an IntegrityError on a publisher's bytes usually means, and the fix (the receiver adds it)
RELEASED_HINT = (
    "if the trainer changed these tensors after publishing them, it must first wait for "
    "`await publisher.released(version)` (or a ReleasePolicy that allows it)"
)


class RefitError(Exception):
    """Root of every error refitflow raises on purpose."""

    def __init__(self, message: str, *, version: int | None = None, tensor: str | None = None) -> None:
        self.version = version
        self.tensor = tensor
        where = []
        if version is not None:
            where.append(f"version {version}")
        if tensor is not None:
            where.append(f"tensor {tensor!r}")
        super().__init__(f"{message} ({', '.join(where)})" if where else message)
        self.reason = message


class ConfigError(RefitError, ValueError):
    """A configuration value that makes no sense."""


class PlanError(RefitError):
    """The publication cannot be mapped onto this rank's parameters."""


class CoverageError(RefitError):
    """Some destination parameter was not written exactly once."""

    def __init__(
        self,
        message: str,
        *,
        missing: list[str] | None = None,
        duplicated: list[str] | None = None,
        version: int | None = None,
    ) -> None:
        self.missing = list(missing or [])
        self.duplicated = list(duplicated or [])
        parts = [message]
        if self.missing:
            parts.append(f"missing {len(self.missing)}: {self.missing[:20]}")
        if self.duplicated:
            parts.append(f"written more than once {len(self.duplicated)}: {self.duplicated[:20]}")
        super().__init__("; ".join(parts), version=version)


class IntegrityError(RefitError):
    """Pulled bytes do not match the digest the publisher announced."""


class TransportError(RefitError):
    """A transport operation failed: dead peer, unknown region, registration failure."""


class OutOfStepError(TransportError):
    """This rank cannot follow a push stream any more and has left the stream's process group."""


class VersionError(RefitError):
    """Version ordering or transaction state was violated."""


class AlreadyCommittedError(VersionError):
    """The version asked for is the one this rank already serves (nothing to refit)."""


class FencedError(RefitError):
    """The rank is not serving a complete, committed version."""


class ManifestError(RefitError, ValueError):
    """A manifest or control message is malformed."""


class FrameError(ManifestError):
    """A push-stream frame was refused; ``kind`` says which check (a small fixed set, for metrics)."""

    def __init__(self, message: str, *, kind: str, version: int | None = None, tensor: str | None = None) -> None:
        super().__init__(message, version=version, tensor=tensor)
        self.kind = kind


class AuthenticationError(RefitError):
    """A CURVE handshake failed: a missing, unknown or mismatched key (the message names the key files)."""


class RoleError(AuthenticationError):
    """The peer knows our key, and its role (trainer, rollout, operator) may not ask for this."""


class RefitTimeoutError(RefitError, TimeoutError):
    """A deadline passed while waiting on another party."""
