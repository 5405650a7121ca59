"""A deployment's CURVE keys in one folder, and where a process finds them.

The folder (made by ``refitflow keys DIR`` or by ``refitflow registry`` on its first run) holds:

- ``server.key_secret`` / ``server.key``: the registry's pair; engine ranks' vote and agent sockets serve
  with it too;
- one pair per role — ``trainer`` (publishers), ``rollout`` (inference ranks: receivers, vote peers),
  ``operator`` (controllers, tools) — ``<role>.key_secret`` / ``<role>.key``: what each process presents;
- ``authorized/<role>/``: the public keys servers admit, by role; the registry lets a key do what its role may
  (``registry/roles.py``: a rollout key cannot publish).

A folder made before roles holds a single ``client`` pair, its public key in ``authorized/`` itself: that key
still works, for every role (the registry warns when it starts), and a process asking for a role the folder
has no pair of presents it. ``refitflow keys DIR`` on such a folder adds the role pairs beside it.

Secret keys are written 0600 in a folder made 0700; public keys 0644 (they are meant to be handed out).
Hosts share the folder (or a copy of it) to talk to each other.

Where a process finds it — read by the CLI and the integrations only, which pass their environment in:
``REFITFLOW_KEYS=DIR``, else ``~/.refitflow/keys``; ``REFITFLOW_KEYS=open`` runs without CURVE, an explicit
choice the caller logs loudly. Which pair it presents is its role (the integrations know theirs).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from refitflow.core.errors import ConfigError
from refitflow.registry.roles import ROLES
from refitflow.registry.security import ClientSecurity, ServerSecurity

__all__ = ["OPEN", "ROLES", "DeploymentKeys", "client_of", "find_keys", "keys_folder", "server_of", "serving_keys",
           "warn_open"]  # fmt: skip

log = logging.getLogger(__name__)

OPEN = "open"  # REFITFLOW_KEYS=open: no CURVE, said out loud
ENV = "REFITFLOW_KEYS"
DEFAULT = Path(".refitflow") / "keys"  # under the user's home
LEGACY = "client"  # the single pair of a folder made before roles: every role
_HOW = (f"run `refitflow registry` once on this host (it makes {Path('~') / DEFAULT}), or `refitflow keys DIR` "
        f"and set {ENV}=DIR; {ENV}=open runs without authentication")  # fmt: skip


def _role_of(name: str) -> str | None:
    """The role a pair named ``name`` (``NAME`` or ``NAME:ROLE``) holds; None: every role (``client``)."""
    base, _, role = name.partition(":")
    role = role or (base if base in ROLES else "")
    if base == LEGACY and not role:
        return None
    if role not in ROLES:
        raise ConfigError(f"key pair {name!r}: say its role, NAME:ROLE with ROLE one of {', '.join(ROLES)} "
                          f"(the names {', '.join(ROLES)} are their own role)")  # fmt: skip
    if not base or "/" in base or base == "server":
        raise ConfigError(f"key pair {name!r}: a name of letters, digits, '-', '_' (not 'server')")
    return role


@dataclass(frozen=True)
class DeploymentKeys:
    folder: Path
    role: str | None = None  # the role this process presents (its pair); None: the folder's single ``client`` pair

    def __post_init__(self) -> None:
        if self.role is not None and self.role not in ROLES:
            raise ConfigError(f"a key role is one of {', '.join(ROLES)}, got {self.role!r}")

    @property
    def server(self) -> ServerSecurity:
        return ServerSecurity(secret_key_file=self.folder / "server.key_secret",
                              authorized_dir=self.folder / "authorized")  # fmt: skip

    @property
    def client(self) -> ClientSecurity:
        """The pair this process presents: its role's, or — a folder made before roles, or no role named — the
        single ``client`` pair (every role)."""
        return self.pair(self.role)

    def as_role(self, role: str) -> DeploymentKeys:
        """The same folder, presenting ``role``'s pair."""
        return dataclasses.replace(self, role=role)

    def pair(self, role: str | None) -> ClientSecurity:
        if role is not None and (self.folder / f"{role}.key_secret").exists():
            return self.client_named(role)
        if (self.folder / f"{LEGACY}.key_secret").exists():
            return self.client_named(LEGACY)
        if role is None:
            raise ConfigError(f"CURVE keys: {self.folder} holds a pair per role ({', '.join(ROLES)}): say which "
                              f"this process presents, rf.DeploymentKeys(folder, role=...) or keys.as_role(...)")
        raise ConfigError(f"CURVE keys: {self.folder / f'{role}.key_secret'} does not exist: `refitflow keys "
                          f"{self.folder}` makes the {role} pair (the pairs there are kept)")  # fmt: skip

    def client_named(self, name: str) -> ClientSecurity:
        return ClientSecurity(secret_key_file=self.folder / f"{name}.key_secret",
                              server_public_file=self.folder / "server.key")  # fmt: skip

    @classmethod
    def load(cls, folder: Path, role: str | None = None) -> DeploymentKeys:
        """The key set in ``folder``; a ``ConfigError`` naming the first missing file and how to make it."""
        keys = cls(Path(folder), role)
        for path in (keys.folder / "server.key_secret", keys.folder / "server.key", keys.folder / "authorized"):
            if not path.exists():
                raise ConfigError(f"CURVE keys: {path} does not exist: {_HOW}")
        return keys

    @classmethod
    def create(cls, folder: Path, clients: Sequence[str] = ROLES, *, replace: bool = True) -> DeploymentKeys:
        """Write a key set into ``folder``: the server pair, one pair per name of ``clients`` (``trainer``,
        ``rollout``, ``operator``: that role; ``NAME:ROLE``: another pair of a role; ``client``: a single pair
        for every role, as folders made before roles), and the allow-list by role. ``replace=False`` keeps
        every pair already there (and makes the missing ones)."""
        from zmq.auth import create_certificates

        roles = {name.partition(":")[0]: _role_of(name) for name in clients}
        folder = Path(folder)
        authorized = folder / "authorized"
        old_umask = os.umask(0o077)  # every file and folder private from its first byte; public keys opened below
        try:
            folder.mkdir(parents=True, exist_ok=True)
            authorized.mkdir(exist_ok=True)
            public_keys = []
            for name, role in [("server", None), *roles.items()]:
                if not replace and (folder / f"{name}.key_secret").exists():
                    continue
                public = Path(create_certificates(str(folder), name)[0])
                public_keys.append(public)
                if name == "server":
                    continue
                for old in [authorized / public.name, *authorized.glob(f"*/{public.name}")]:
                    old.unlink(missing_ok=True)  # a pair made again: its old key admitted nowhere
                place = authorized if role is None else authorized / role
                place.mkdir(exist_ok=True)
                shutil.copy(public, place / public.name)
                public_keys.append(place / public.name)
        finally:
            os.umask(old_umask)
        for path in public_keys:
            path.chmod(0o644)
        for place in [authorized, *(p for p in authorized.iterdir() if p.is_dir())]:
            place.chmod(0o755)
        return cls(folder)

    @classmethod
    def ensure(cls, folder: Path) -> tuple[DeploymentKeys, bool]:
        """The key set in ``folder``, made there first if the folder holds none; and whether it was made."""
        if not (Path(folder) / "server.key_secret").exists():
            return cls.create(folder), True
        return cls.load(folder), False


def keys_folder(env: Mapping[str, str], home: Path) -> Path | None:
    """Where this process's keys are (``REFITFLOW_KEYS``, else ``home/.refitflow/keys``); None: run open."""
    chosen = env.get(ENV, "").strip()
    if chosen == OPEN:
        return None
    return Path(chosen).expanduser() if chosen else home / DEFAULT


def find_keys(env: Mapping[str, str], home: Path, role: str | None = None) -> DeploymentKeys | None:
    """The deployment's keys for a client or an engine rank, presenting ``role``'s pair (``trainer``, ``rollout``,
    ``operator``); None when ``REFITFLOW_KEYS=open`` (logged)."""
    folder = keys_folder(env, home)
    if folder is None:
        warn_open("this process")
        return None
    return DeploymentKeys.load(folder, role)


def serving_keys(folder: Path | None, what: str) -> tuple[DeploymentKeys | None, bool]:
    """For a process that serves (the registry, the demo): the keys in ``folder`` (``keys_folder``'s answer, or
    one given), made there first if it holds none; and whether they were made. None: run open (logged)."""
    if folder is None:
        warn_open(what)
        return None, False
    return DeploymentKeys.ensure(folder)


def warn_open(what: str) -> None:
    log.warning("%s runs WITHOUT CURVE (%s=%s): anyone who reaches its sockets can publish, vote and command; "
                "use it only on a private network", what, ENV, OPEN)  # fmt: skip


def server_of(keys: DeploymentKeys | None) -> ServerSecurity | None:
    """A server socket's CURVE from ``keys`` (None: open)."""
    return None if keys is None else keys.server


def client_of(keys: DeploymentKeys | None, role: str | None = None) -> ClientSecurity | None:
    """A client socket's CURVE from ``keys`` (None: open): the pair of the role ``keys`` names, else of ``role``."""
    return None if keys is None else keys.pair(keys.role or role)
