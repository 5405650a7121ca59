"""Transports: how bytes move between processes. The ``Transport`` seam (register memory, announce
an address, one-sided reads), ``LoopbackTransport`` (in one process, the stand-in every pipeline
test uses) and real transports (NIXL), whose libraries are imported lazily. Imports only ``core``.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from refitflow.core.errors import ConfigError
from refitflow.transports.base import Read, Transport, as_bytes
from refitflow.transports.loopback import LoopbackTransport

__all__ = ["LoopbackTransport", "Read", "Transport", "as_bytes", "make_transport", "nixl_installed"]

TRANSPORTS = ("loopback", "nixl")


def nixl_installed() -> bool:
    """Whether the optional ``nixl`` package can be imported (found without importing it: that takes seconds)."""
    try:
        return importlib.util.find_spec("nixl") is not None
    except (ImportError, ValueError):  # ValueError: a module entry without a spec (e.g. import blocked)
        return False


def make_transport(spec: str | Transport, **options: Any) -> Transport:
    """A transport from its name (``"loopback"``, ``"nixl"``) or an instance, passed through."""
    if isinstance(spec, Transport):
        return spec
    if spec == "loopback":
        return LoopbackTransport()
    if spec == "nixl":
        from refitflow.transports.nixl import NixlTransport  # lazy: nixl is an optional dependency

        return NixlTransport(**options)
    raise ConfigError(f"unknown transport {spec!r}; choose one of {TRANSPORTS}")
