"""The registry's service side: the ZMQ service (``server``, ``ops``, ``admission``), the stores it serves
(``registry.protocol.Store``: in memory, ``store`` with ``model``, ``leases``, ``checks``, ``relays``,
``near_misses``; or in etcd, ``etcd``) and the embedded ``rf.Registry`` (``embedded``)."""

from refitflow.registry.service.server import RegistryServer, serve

__all__ = ["RegistryServer", "serve"]
