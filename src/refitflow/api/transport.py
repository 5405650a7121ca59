"""Which transport a publisher or receiver uses: ``"auto"`` picks it from the registry it was given.

- a registry address or an ``rf.RegistryClient`` (a registry service other processes share): ``nixl``,
  which must be installed;
- a registry object (``rf.Registry``: everything in this process): ``loopback``.

``loopback`` reaches only peers of this process, so it is refused with a registry address or client.
"""

from __future__ import annotations

from typing import Any

from refitflow.core.errors import ConfigError
from refitflow.transports import Transport, nixl_installed

__all__ = ["choose_transport"]


def choose_transport(spec: str | Transport, registry: Any) -> str | Transport:
    """The transport to make for ``spec`` (``"auto"``, a name, or an instance) beside ``registry``."""
    if isinstance(spec, Transport):
        return spec
    if not isinstance(spec, str):
        raise ConfigError(f"transport must be 'auto', 'loopback', 'nixl' or a Transport, got {spec!r}")
    where = registry if isinstance(registry, str) else getattr(registry, "address", None)
    # an address, or a client of one (``RegistryClient.address``); inproc:// lives in one process
    shared = isinstance(where, str) and not where.startswith("inproc://")
    named = f"the registry at {where}"
    if spec == "auto":
        if not shared:
            return "loopback"
        if not nixl_installed():
            raise ConfigError(
                f"transport='auto' with {named} needs NIXL to reach other processes: pip install 'refitflow[nixl]' "
                "(or, to run everything in this one process, pass the rf.Registry object and transport='loopback')"
            )
        return "nixl"
    if spec == "loopback" and shared:
        raise ConfigError(
            f"transport='loopback' reaches only this process, but {named} is shared between processes: "
            "use transport='nixl' (or the default 'auto'), or pass the rf.Registry object itself "
            "(server.registry for one you serve) to run everything in this process"
        )
    return spec
