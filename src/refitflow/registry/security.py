"""CURVE keys: a client's key pair and the server's public key; the server's secret key and allow-list.

One key set serves a whole deployment (``refitflow keys``): the registry, every engine rank's vote
and agent sockets are CURVE servers with the server key pair and the allow-list; every client
(publishers, receivers, vote peers, the controller) holds its own pair — its role's — and the server's
public key. The allow-list is the folder's public keys and those of its role folders (``roles``).
"""

from __future__ import annotations

import ipaddress
import logging
import stat
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq

from refitflow.core.errors import ConfigError
from refitflow.registry.roles import KeyRoles, role_keys

__all__ = ["ClientSecurity", "ServerSecurity", "check_exposed"]

log = logging.getLogger(__name__)


def check_exposed(address: str, what: str, *, insecure: bool) -> None:
    """Refuse to bind ``address`` without CURVE where other hosts reach it, unless told to (``insecure``,
    then logged as a warning): running open is a choice, never a default."""
    scheme, _, rest = address.partition("://")
    if scheme != "tcp" or ":" not in rest:  # not TCP, or no host:port (binding it fails, saying so)
        return
    host = rest.rsplit(":", 1)[0].strip("[]")
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False  # '*' or a host name
    if loopback:
        return
    if not insecure:
        raise ConfigError(f"{what} would bind {address} without CURVE, where anyone who reaches it can send it "
                          "commands: give it the deployment's keys (rf.DeploymentKeys), or insecure=True to run it "
                          "open on a private network")  # fmt: skip
    log.warning("%s bound on %s WITHOUT CURVE (insecure=True): anyone who reaches it can send it commands",
                what, address)  # fmt: skip


def _warn_if_readable_by_others(secret: Path) -> None:
    mode = Path(secret).stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("CURVE secret key %s is readable by others (mode %o): chmod 600 it", secret, mode & 0o777)


@dataclass(frozen=True, kw_only=True)
class ClientSecurity:
    secret_key_file: Path  # this client's ``.key_secret`` (its ``.key`` must be in the server's allow-list)
    server_public_file: Path  # the registry's ``.key``

    def __post_init__(self) -> None:
        for path in (self.secret_key_file, self.server_public_file):
            if not Path(path).is_file():
                raise ConfigError(f"CURVE key file {path} does not exist")
        _warn_if_readable_by_others(self.secret_key_file)

    def apply(self, sock: zmq.Socket) -> None:
        from zmq.auth import load_certificate

        public, secret = load_certificate(str(self.secret_key_file))
        server_public, _ = load_certificate(str(self.server_public_file))
        if secret is None:
            raise ConfigError(f"{self.secret_key_file} holds no secret key")
        sock.curve_secretkey, sock.curve_publickey, sock.curve_serverkey = secret, public, server_public


@dataclass(frozen=True, kw_only=True)
class ServerSecurity:
    """CURVE: the server's secret key file, and a folder of the public keys of allowed clients."""

    secret_key_file: Path
    authorized_dir: Path

    def __post_init__(self) -> None:
        if not Path(self.secret_key_file).is_file():
            raise ConfigError(f"server secret key file {self.secret_key_file} does not exist")
        if not Path(self.authorized_dir).is_dir():
            raise ConfigError(f"authorized client keys folder {self.authorized_dir} does not exist")
        _warn_if_readable_by_others(self.secret_key_file)

    def apply(self, sock: zmq.Socket) -> None:
        """Make ``sock`` a CURVE server with this key pair (before it binds)."""
        from zmq.auth import load_certificate

        public, secret = load_certificate(str(self.secret_key_file))
        if secret is None:
            raise ConfigError(f"{self.secret_key_file} holds no secret key")
        sock.curve_secretkey, sock.curve_publickey, sock.curve_server = secret, public, True

    def roles(self) -> KeyRoles:
        """The allow-list's keys and their roles (``roles.role_keys``)."""
        return KeyRoles(role_keys(Path(self.authorized_dir)))

    def allow(self, auth: Any, only: Collection[str] | None = None) -> KeyRoles:
        """Make a started ``zmq.auth`` authenticator admit exactly the allow-list's keys — every role's, or those of
        the roles ``only`` names (a key of every role, from a folder made before roles, holds each); the roles."""
        roles = self.roles()
        auth.configure_curve_callback(domain="*", credentials_provider=_Allowed(roles, only))
        return roles

    def authenticator(self, context: zmq.Context, only: Collection[str] | None = None) -> Any:
        """Start (in a thread) the handler that admits only the allow-list's clients on ``context`` (of the roles
        ``only`` names, if given: the engine's vote admits rollout keys alone).

        Start it before binding: a CURVE server with no handler admits any client key. Stop it
        (``.stop()``) before terminating the context.
        """
        from zmq.auth.thread import ThreadAuthenticator

        auth = ThreadAuthenticator(context)
        auth.start()
        self.allow(auth, only)
        return auth


class _Allowed:
    """``zmq.auth``'s credentials provider: a client key is admitted when the allow-list holds it."""

    def __init__(self, roles: KeyRoles, only: Collection[str] | None) -> None:
        self._roles, self._only = roles, only

    def callback(self, domain: str, key: bytes) -> bool:
        return self._roles.knows(key.decode(), self._only)
