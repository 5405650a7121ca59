"""``rf.Registry``: the embedded registry (``RegistryStore``), which can also serve itself over ZMQ."""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from typing import Any

from refitflow.registry.service import RegistryServer, serve
from refitflow.registry.store import RegistryStore

__all__ = ["Registry"]


class Registry(RegistryStore):
    """In one process. All methods are coroutines, as they are on a remote registry client."""

    @classmethod
    def serve(
        cls, address: str = "tcp://127.0.0.1:7100", **options: Any
    ) -> AbstractAsyncContextManager[RegistryServer]:
        """Serve a registry over ZMQ at ``address`` while the context is open (see ``registry.service.serve``)."""
        return serve(address, **options)
