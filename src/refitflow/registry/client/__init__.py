"""The registry's client side: ``RegistryClient`` (``client``) over one ``Channel`` per replica (``channel``,
``replicas``), announcements (``announcements``), fetched manifests (``fetched``), what it keeps told
(``upkeep``), and ``connect_registry``."""

from refitflow.registry.client.client import RegistryClient

__all__ = ["RegistryClient"]
