"""What the registry accepts: message sizes, requests in flight (in all and per client), manifest sizes,
how far a version may jump ahead, how long an unowned incomplete version is kept.

Absolute limits on what a manifest may hold at all (tensor names, shapes, world size) live with the
manifest itself (``core.types``); these are the registry's own, set per deployment.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from refitflow.core.errors import ConfigError

__all__ = ["RegistryLimits"]


@dataclass(frozen=True, kw_only=True)
class RegistryLimits:
    # a request frame over this is answered ManifestError (ZMQ drops the connection of one over twice it)
    max_message_bytes: int = 1 << 26
    # requests worked on at once (long waits included); beyond it a request is answered "busy" at once
    max_in_flight: int = 1024
    # of which one client (one connection, or one CURVE key on one host) may hold this many
    max_in_flight_per_client: int = 128
    # and all the clients of one host (one IP address) together this many: a flood of sockets from one host
    # leaves the other hosts at least max_in_flight - max_in_flight_per_host
    max_in_flight_per_host: int | None = None  # None: half of max_in_flight (at least max_in_flight_per_client)
    # request bytes held at once (what a flood of large manifests can pin)
    max_in_flight_bytes: int = 1 << 30
    # shard specs in one manifest (checked before any is built)
    max_shards: int = 1 << 17
    # a version more than this above the newest complete version of its identity (with none: above the newest
    # version a registered receiver committed) is refused (None: no bound)
    max_version_ahead: int | None = 10_000
    # an incomplete version that no live client owns is dropped this long after its first manifest
    incomplete_ttl_s: float = 300.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("max_version_ahead", "max_in_flight_per_host") and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ConfigError(f"registry limit {f.name} must be a positive number, got {value!r}")
            if f.name != "incomplete_ttl_s" and not isinstance(value, int):
                raise ConfigError(f"registry limit {f.name} must be an integer, got {value!r}")
        if not self.max_in_flight_per_client <= self.per_host <= self.max_in_flight:
            raise ConfigError("max_in_flight_per_client ≤ max_in_flight_per_host ≤ max_in_flight, please")

    @property
    def per_host(self) -> int:
        """What the clients of one host may hold in flight together."""
        if self.max_in_flight_per_host is not None:
            return self.max_in_flight_per_host
        return max(self.max_in_flight_per_client, self.max_in_flight // 2)
