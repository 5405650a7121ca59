"""Python's cyclic collector held off while a registry process decodes a large request.

Decoding a manifest of 100,000 shard specs makes a few hundred thousand objects; the collector's passes
over them (a full pass, once enough of them survive, walks everything held) stopped the event loop for up
to 0.14 s at a time — on the loop's own thread, or from the worker thread that builds the manifest, which
holds the interpreter for the whole pass. In a process that is the registry's alone (``serve(freeze_gc=
True)``), the collector is paused from the first byte of a large request to its answer, then what the
registry now holds — long-lived and acyclic — is frozen out of later passes (``gc.freeze``). Plain
reference counting still frees everything meanwhile; only cyclic garbage waits.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["GcPause"]


class GcPause:
    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._held = 0  # large requests being handled now

    @contextmanager
    def during(self, large: bool) -> Iterator[None]:
        if not (self.enabled and large):
            yield
            return
        self._held += 1
        gc.disable()
        try:
            yield
        finally:
            self._held -= 1
            if not self._held:
                gc.freeze()
                gc.enable()
