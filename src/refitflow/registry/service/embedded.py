"""``rf.Registry``: the embedded registry (``RegistryStore``), which can also serve itself over ZMQ."""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from typing import Any

from refitflow.registry.service.server import RegistryServer, serve
from refitflow.registry.service.store import RegistryStore

__all__ = ["Registry"]


class Registry(RegistryStore):
    """Where publishers announce versions and receivers find them: in this process, or served to others.

    ``rf.Registry()`` is in-memory; give the object itself to ``Publisher``/``Receiver`` in the same
    process (they then use the loopback transport). ``Registry.serve(address)`` runs one as a ZMQ service
    for other processes (or run ``refitflow registry``), which they reach by its address::

        async with rf.Registry.serve("tcp://127.0.0.1:7100") as server:   # server.registry: this object
            ...                                                          # others: rf.Publisher(server.address, ...)

    Arguments: ``lease_s`` (10): an owner (a remote client) silent this long loses what it published or
    registered; ``limits`` (``rf.RegistryLimits()``): what one request, one client and one manifest may
    ask of it (sizes, in-flight requests, how far ahead a version may jump; see docs/registry.md). A
    version is discoverable once every rank of its world published it, released per the publisher's
    ``rf.ReleasePolicy``, and dropped once released and superseded. All methods are coroutines, as they
    are on ``rf.RegistryClient``: ``publish``, ``latest``, ``wait_complete``,
    ``register_receiver``, ``report``, ``is_released``, ``wait_released``, ``acked``, ``versions``,
    ``near_misses`` (what is held instead, for a discovery that found nothing) and the relay calls
    (``relay_join``, ``relay_leave``: pipelined fan-out, ``registry.relays``).
    """

    @classmethod
    def serve(
        cls, address: str = "tcp://127.0.0.1:7100", **options: Any
    ) -> AbstractAsyncContextManager[RegistryServer]:
        """Serve a registry over ZMQ at ``address`` while the context is open (see ``registry.service.serve``)."""
        return serve(address, **options)
