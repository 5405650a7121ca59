"""Turn what a user passed as ``registry`` into a registry object (ZMQ is imported only for an address)."""

from __future__ import annotations

from typing import Any

__all__ = ["connect_registry"]


def connect_registry(spec: Any) -> Any:
    """An address string (``tcp://…``) becomes a ``RegistryClient``; a registry object is used as it is."""
    if isinstance(spec, str):
        from refitflow.registry.client import RegistryClient

        return RegistryClient(spec)
    return spec
