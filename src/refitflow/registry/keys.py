"""A deployment's CURVE keys in one folder, and where a process finds them.

The folder (made by ``refitflow keys DIR`` or by ``refitflow registry`` on its first run) holds:

- ``server.key_secret`` / ``server.key``: the registry's pair; engine ranks' vote and agent sockets serve
  with it too;
- ``client.key_secret`` / ``client.key``: what publishers, receivers, vote peers and controllers present;
- ``authorized/``: the public keys servers admit (``client.key`` at least).

Secret keys are written 0600 in a folder made 0700; public keys 0644 (they are meant to be handed out).
Hosts share the folder (or a copy of it) to talk to each other.

Where a process finds it — read by the CLI and the integrations only, which pass their environment in:
``REFITFLOW_KEYS=DIR``, else ``~/.refitflow/keys``; ``REFITFLOW_KEYS=open`` runs without CURVE, an explicit
choice the caller logs loudly.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from refitflow.core.errors import ConfigError
from refitflow.registry.security import ClientSecurity, ServerSecurity

__all__ = ["OPEN", "DeploymentKeys", "client_of", "find_keys", "keys_folder", "server_of", "serving_keys",
           "warn_open"]  # fmt: skip

log = logging.getLogger(__name__)

OPEN = "open"  # REFITFLOW_KEYS=open: no CURVE, said out loud
ENV = "REFITFLOW_KEYS"
DEFAULT = Path(".refitflow") / "keys"  # under the user's home
_HOW = (f"run `refitflow registry` once on this host (it makes {Path('~') / DEFAULT}), or `refitflow keys DIR` "
        f"and set {ENV}=DIR; {ENV}=open runs without authentication")  # fmt: skip


@dataclass(frozen=True)
class DeploymentKeys:
    folder: Path

    @property
    def server(self) -> ServerSecurity:
        return ServerSecurity(secret_key_file=self.folder / "server.key_secret",
                              authorized_dir=self.folder / "authorized")  # fmt: skip

    @property
    def client(self) -> ClientSecurity:
        return self.client_named("client")

    def client_named(self, name: str) -> ClientSecurity:
        return ClientSecurity(secret_key_file=self.folder / f"{name}.key_secret",
                              server_public_file=self.folder / "server.key")  # fmt: skip

    @classmethod
    def load(cls, folder: Path) -> DeploymentKeys:
        """The key set in ``folder``; a ``ConfigError`` naming the first missing file and how to make it."""
        keys = cls(Path(folder))
        for path in (keys.folder / "server.key_secret", keys.folder / "server.key",
                     keys.folder / "client.key_secret", keys.folder / "authorized"):  # fmt: skip
            if not path.exists():
                raise ConfigError(f"CURVE keys: {path} does not exist: {_HOW}")
        return keys

    @classmethod
    def create(cls, folder: Path, clients: Sequence[str] = ("client",), *, replace: bool = True) -> DeploymentKeys:
        """Write a key set (a server pair, one pair per client name, the allow-list) into ``folder``;
        ``replace=False`` keeps every pair already there (and makes the missing ones)."""
        from zmq.auth import create_certificates

        folder = Path(folder)
        authorized = folder / "authorized"
        old_umask = os.umask(0o077)  # every file and folder private from its first byte; public keys opened below
        try:
            folder.mkdir(parents=True, exist_ok=True)
            authorized.mkdir(exist_ok=True)
            public_keys = []
            for name in ("server", *clients):
                if not replace and (folder / f"{name}.key_secret").exists():
                    continue
                public = Path(create_certificates(str(folder), name)[0])
                public_keys.append(public)
                if name != "server":
                    shutil.copy(public, authorized / public.name)
                    public_keys.append(authorized / public.name)
        finally:
            os.umask(old_umask)
        for path in public_keys:
            path.chmod(0o644)
        authorized.chmod(0o755)
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


def find_keys(env: Mapping[str, str], home: Path) -> DeploymentKeys | None:
    """The deployment's keys for a client or an engine rank; None when ``REFITFLOW_KEYS=open`` (logged)."""
    folder = keys_folder(env, home)
    if folder is None:
        warn_open("this process")
        return None
    return DeploymentKeys.load(folder)


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


def client_of(keys: DeploymentKeys | None) -> ClientSecurity | None:
    """A client socket's CURVE from ``keys`` (None: open)."""
    return None if keys is None else keys.client
