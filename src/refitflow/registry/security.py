"""CURVE keys: a client's key pair and the registry's public key; the server's secret key and allow-list."""

from __future__ import annotations

import logging
import stat
from dataclasses import dataclass
from pathlib import Path

import zmq

from refitflow.core.errors import ConfigError

__all__ = ["ClientSecurity", "ServerSecurity"]

log = logging.getLogger(__name__)


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
