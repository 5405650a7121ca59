"""Owners and their leases in the in-memory store: when each remote client last heartbeat, what it holds, and
the ranks it publishes (one live publisher per rank).

An owner silent for a lease loses what it held (``stale``); a rank's claim ends with its owner's lease or
its ``goodbye``. Nothing here knows manifests or receivers: the store says what a key holds.
"""

from __future__ import annotations

from collections.abc import Callable

from refitflow.core.types import Identity

__all__ = ["Key", "Leases"]

Key = tuple[Identity, int | str, int]  # (identity, version | receiver id, rank | -1)


class Leases:
    def __init__(self) -> None:
        self.last: dict[str, float] = {}  # owner -> its last heartbeat
        self.owned: dict[str, set[Key]] = {}  # owner -> what it holds
        self.claims: dict[tuple[Identity, int], str] = {}  # (identity, rank) -> the owner publishing it

    def own(self, owner: str, key: Key, now: float, gone: Callable[[Key], bool]) -> None:
        """``owner`` holds ``key`` (and is alive at ``now``); ``gone``: whether a key it held went since."""
        self.last[owner] = now
        owned = self.owned.setdefault(owner, set())
        n = len(owned)  # forget what went since, so a long-lived owner's record stays small: at 64,
        if n >= 64 and not n & (n - 1):  # 128, 256, … entries (every publish once past 64 was O(owned))
            owned -= {k for k in owned if gone(k)}
        owned.add(key)

    def holder(self, identity: Identity, rank: int) -> str | None:
        """The live owner publishing ``rank`` of ``identity``, if any."""
        holder = self.claims.get((identity, rank))
        return holder if holder in self.last else None

    def claim(self, identity: Identity, rank: int, owner: str) -> None:
        self.claims[(identity, rank)] = owner

    def heartbeat(self, owner: str, now: float) -> bool:
        """Extend ``owner``'s lease; False when it had none (the registry restarted, or it expired)."""
        known = owner in self.last
        self.last[owner] = now
        return known

    def goodbye(self, owner: str) -> None:
        """``owner`` closed: its ranks may be published by another client at once."""
        self.claims = {k: o for k, o in self.claims.items() if o != owner}

    def extend(self, seconds: float) -> None:
        """Every lease lives ``seconds`` longer (heartbeats could not be read for that long)."""
        self.last = {o: t + seconds for o, t in self.last.items()}

    def stale(self, now: float, lease_s: float) -> dict[str, set[Key]]:
        """Forget every owner silent for more than ``lease_s``, with its claims; what each held."""
        stale = [o for o, t in self.last.items() if now - t > lease_s]
        if stale:
            gone = set(stale)
            self.claims = {k: o for k, o in self.claims.items() if o not in gone}
        out = {}
        for owner in stale:
            del self.last[owner]
            out[owner] = self.owned.pop(owner, set())
        return out
