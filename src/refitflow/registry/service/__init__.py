"""The registry's service side: the ZMQ service (``server``, ``ops``, ``admission``), the stores it serves
(``store_api.Store``: in memory, ``store`` with ``model``, ``checks``, ``relays``, ``near_misses``; or in etcd,
``etcd``) and the embedded ``rf.Registry`` (``embedded``)."""

from refitflow.registry.service.server import RegistryServer, serve

__all__ = ["RegistryServer", "serve"]
