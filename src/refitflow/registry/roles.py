"""Roles: which key may ask the registry what.

A deployment's key folder (``registry/keys.py``) holds one CURVE pair per role and the allow-list by role:

- ``authorized/trainer/*.key``: publishers (``publish``, ``complete``);
- ``authorized/rollout/*.key``: inference ranks (``register_receiver``, ``unregister_receiver``, ``report``,
  ``relay_join``, ``relay_leave``);
- ``authorized/operator/*.key``: people and tools that watch and tend (``unregister_receiver``: evict a
  receiver that holds releases back; ``relay_leave``);

and every role reads (``hello``, ``latest``, ``manifests``, ``publication``, ``layouts``, ``part``,
``versions``, ``relayed``, ``near_misses``, ``acked``, ``is_released``, ``wait_released``) and keeps its own
lease (``heartbeat``, ``goodbye``). A key in ``authorized/`` itself — a folder made before roles
existed — holds every role (the registry says so when it starts). A public key's role is the folder it lies
in; a key in two folders is refused.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path

from refitflow.core.errors import ConfigError, RoleError

__all__ = ["EVERY", "ROLES", "KeyRoles", "fingerprint", "may", "role_keys"]

ROLES = ("trainer", "rollout", "operator")
EVERY = "every role"  # a key in authorized/ itself (a folder made before per-role keys)

_LEASE = frozenset({"hello", "heartbeat", "goodbye"})
_READS = frozenset({"latest", "manifests", "publication", "layouts", "part", "versions", "relayed", "near_misses",
                    "acked", "is_released", "wait_released"})  # fmt: skip
_WRITES: Mapping[str, frozenset[str]] = {
    "trainer": frozenset({"publish", "complete"}),
    "rollout": frozenset({"register_receiver", "unregister_receiver", "report", "relay_join", "relay_leave"}),
    "operator": frozenset({"unregister_receiver", "relay_leave"}),
}
_GUARDED = frozenset().union(*_WRITES.values())
_WHO = {op: [r for r in ROLES if op in _WRITES[r]] for op in _GUARDED}


def may(role: str, op: object) -> bool:
    """Whether a key of ``role`` may send ``op`` (an op no role writes with, or an unknown one, is not guarded
    here: reads, leases, and what the service refuses as unknown)."""
    return role == EVERY or op not in _GUARDED or op in _WRITES.get(role, ())


def fingerprint(public_key: str) -> str:
    """A short, stable name of a public key (z85), safe in an etcd key: what binds an owner id to its key."""
    return hashlib.blake2b(public_key.encode(), digest_size=8).hexdigest()


@dataclass(frozen=True)
class Holder:
    role: str
    file: Path  # the public key file that gave the role (named in refusals)


def role_keys(authorized: Path) -> dict[str, Holder]:
    """Every public key of the allow-list (z85) and its role; ``ConfigError`` for a folder that names no role or
    a key found in two places."""
    from zmq.auth import load_certificate

    found: dict[str, Holder] = {}
    folders = [(authorized, EVERY)]
    for sub in sorted(p for p in Path(authorized).iterdir() if p.is_dir()):
        if sub.name not in ROLES:
            raise ConfigError(f"{sub} names no role: the roles are {', '.join(ROLES)} ({authorized}/<role>/*.key)")
        folders.append((sub, sub.name))
    for folder, role in folders:
        for path in sorted(folder.glob("*.key")):
            public, _ = load_certificate(str(path))
            key = public.decode()
            if key in found:
                raise ConfigError(f"the public key of {path} is also {found[key].file}: a key holds one role")
            found[key] = Holder(role, path)
    return found


class KeyRoles:
    """A serving registry's keys and roles: refuses what a key's role may not do, and binds owner ids to keys."""

    def __init__(self, keys: Mapping[str, Holder]) -> None:
        self._keys = dict(keys)

    def knows(self, key: str, roles: Collection[str] | None = None) -> bool:
        """Whether ``key`` is in the allow-list (holding one of ``roles``, when given; a key of every role does)."""
        holder = self._keys.get(key)
        return holder is not None and (roles is None or holder.role == EVERY or holder.role in roles)

    @property
    def legacy(self) -> list[Path]:
        """The key files that hold every role (a folder made before roles)."""
        return [h.file for h in self._keys.values() if h.role == EVERY]

    def admit(self, msg: dict[str, object], key: str) -> None:
        """Refuse (``RoleError``) a request the role of ``key`` (the sender's z85 public key, from its CURVE
        handshake) may not send; and make its ``owner`` (lease and claims) the key's own: ``owner@fingerprint``,
        so a rank's claim is held by the key that took it, whatever owner id another client sends."""
        holder = self._keys.get(key)
        op = msg.get("op")
        if holder is None:
            raise RoleError("this client's key is not in the registry's allow-list any more")
        if not may(holder.role, op):
            who = " or ".join(f"a {r} key" for r in _WHO[str(op)])
            raise RoleError(f"this client's key ({holder.file.name}: {holder.role}) may not {op}: that takes {who}")
        owner = msg.get("owner")
        if isinstance(owner, str):
            msg["owner"] = f"{owner}@{fingerprint(key)}"
