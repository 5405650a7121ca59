"""Turn what a user passed as ``registry`` into a registry object (ZMQ is imported only for an address)."""

from __future__ import annotations

from typing import Any

from refitflow.core.errors import ConfigError
from refitflow.registry.address import check_addresses
from refitflow.registry.keys import DeploymentKeys
from refitflow.registry.security import ClientSecurity

__all__ = ["connect_registry"]


def connect_registry(spec: Any, security: ClientSecurity | DeploymentKeys | None = None, role: str | None = None
                     ) -> Any:  # fmt: skip
    """An address string (``tcp://…``; replicas: ``tcp://h1:7100,tcp://h2:7100``) becomes a ``RegistryClient``;
    a registry object is used as it is. ``security``: the client's CURVE keys (or the deployment's key set: the
    pair of its own role if it names one, else of ``role``, the caller's — a publisher is a trainer), for an
    address only."""
    if isinstance(security, DeploymentKeys):
        security = security.pair(security.role or role)
    if isinstance(spec, str):
        from refitflow.registry.client.client import RegistryClient

        return RegistryClient(check_addresses(spec), security=security)
    if security is not None:
        raise ConfigError("security= is for a registry address; give the registry client its own keys")
    if not callable(getattr(spec, "publish", None)) and not callable(getattr(spec, "wait_complete", None)):
        raise ConfigError(
            f"registry must be an rf.Registry, an rf.RegistryClient or an address such as 'tcp://127.0.0.1:7100', "
            f"got {type(spec).__name__}"
        )
    return spec
