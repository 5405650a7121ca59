"""What each of a rank's storages holds, by digest (delta refits: ``planner/delta.py``).

A rank has one storage (``in_place``: the live parameters) or two (``shadow``: the live parameters and
the copy the next version is written into, which trade places at a swap commit). Storage ``g % 2`` is
live after ``g`` swaps (``Destination.generation``); with ``shadow_commit="copy"`` storage 0 stays live
and storage 1 is always written. Each storage's entry is ``(digest geometry, digest vector)`` of the
version it holds completely, or absent when unknown (never written by a verified pull, or partly
overwritten by an attempt that aborted).
"""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np

__all__ = ["Holding", "Holdings"]

Holding = tuple[Hashable, np.ndarray]


class Holdings:
    def __init__(self, *, shadow: bool, swaps: bool) -> None:
        self.shadow = shadow
        self.swaps = swaps  # shadow commits swap storages (not copy)
        self._held: dict[int, Holding] = {}

    def ids(self, generation: int) -> tuple[int, int]:
        """(target, live) storage ids after ``generation`` swaps."""
        live = generation % 2 if self.swaps else 0
        return (1 - live if self.shadow else live), live

    def get(self, which: str, generation: int) -> Holding | None:
        target, live = self.ids(generation)
        return self._held.get(target if which == "target" else live)

    def committed(self, generation: int, holding: Holding | None) -> None:
        """The target storage (before the swap) holds ``holding``'s version now; a copy commit also the live one."""
        target, live = self.ids(generation)
        ids = (target, live) if self.shadow and not self.swaps else (target,)
        for i in ids:
            if holding is None:
                self._held.pop(i, None)
            else:
                self._held[i] = holding

    def overwritten(self, generation: int, *, live_too: bool = False) -> None:
        """An aborted attempt wrote into the target storage (``live_too``: also into the live one)."""
        target, live = self.ids(generation)
        self._held.pop(target, None)
        if live_too:
            self._held.pop(live, None)
