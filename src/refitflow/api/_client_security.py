"""CURVE on the client side: this client's key pair and the registry's public key."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import zmq

from refitflow.core.errors import ConfigError

__all__ = ["ClientSecurity"]


@dataclass(frozen=True, kw_only=True)
class ClientSecurity:
    secret_key_file: Path  # this client's ``.key_secret`` (its ``.key`` must be in the server's allow-list)
    server_public_file: Path  # the registry's ``.key``

    def __post_init__(self) -> None:
        for path in (self.secret_key_file, self.server_public_file):
            if not Path(path).is_file():
                raise ConfigError(f"CURVE key file {path} does not exist")

    def apply(self, sock: zmq.Socket) -> None:
        from zmq.auth import load_certificate

        public, secret = load_certificate(str(self.secret_key_file))
        server_public, _ = load_certificate(str(self.server_public_file))
        if secret is None:
            raise ConfigError(f"{self.secret_key_file} holds no secret key")
        sock.curve_secretkey, sock.curve_publickey, sock.curve_serverkey = secret, public, server_public
