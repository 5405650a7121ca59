"""Delta refits: a piece whose every digest unit is unchanged since the version a storage holds is not pulled.

A receiver keeps, per storage (the live parameters; in shadow mode also the shadow copy), the digest
vector of the version that storage holds, with its digest geometry (``DigestIndex.geometry``, in ``checks``:
digests compare unit by unit only within one algorithm and tiling). For the next version, a piece is

- ``PULL`` (0): read it, as always;
- ``HELD`` (1): every unit it touches has the same digest as in the target storage's version, so the
  target already holds its bytes: nothing is read or written;
- ``COPY`` (2): shadow mode, the target storage is stale but the live storage holds the bytes: they are
  copied from the live parameters (a local copy instead of a read).

Only *local* pieces are ever skipped: the receiver holds every byte of the piece itself (same dtype, its
box exactly covered by its scatters, no float8 assembly) and every byte is inside whole digest units it
can check (``Checks.piece_checked``). So a skipped piece can always be re-hashed where it lies and
checked against this version's digests: verify does so for ``RECHECK`` pieces, a rotating share of the
skipped ones (every skipped piece at least once every ``1 / recheck_fraction`` refits; all of them with
1.0), and re-reads any that differ. The decision is O(units) numpy per refit; the index is built once
per plan.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from refitflow.core.threads import breathe
from refitflow.layouts.boxes import volume
from refitflow.planner.records import Piece, Plan

__all__ = ["COPY", "HELD", "PULL", "DeltaIndex", "Skips", "decide", "delta_index"]

PULL, HELD, COPY = 0, 1, 2


def _local(p: Piece, dtypes: Mapping[str, str | None], assembled: frozenset[str]) -> bool:
    """Whether the receiver holds every byte of piece ``p`` as the publisher sent it (never an assembly's)."""
    scatters = p.scatters
    if not scatters or any(s.param in assembled for s in scatters):
        return False
    if any(dtypes[s.param] != p.src_dtype for s in scatters):
        return False
    return sum(volume(s.sub) for s in scatters) == volume(p.box)


class DeltaIndex:
    """Per plan: every piece's place (bucket starts), whether it may be skipped, its bytes, and the digest
    units each skippable piece touches (``unit_piece``: global piece index; ``unit_want``: digest index)."""

    def __init__(self, plan: Plan) -> None:
        starts, ok_parts, piece_parts, want_parts, nbytes = [], [], [], [], []
        assembled, dtypes = plan.route.assembled, plan.receiver.dtypes
        g = 0
        for b in plan.buckets:
            breathe()
            ch = b.checks
            n = len(b.pieces)
            starts.append(g)
            size = np.array([p.nbytes for p in b.pieces], dtype=np.int64)
            ok = (ch.piece_checked == size) & np.array([_local(p, dtypes, assembled) for p in b.pieces], dtype=bool)
            ok_parts.append(ok)
            nbytes.append(size)
            piece_parts.append(g + ch.land_of)
            want_parts.append(ch.want)
            for m in ch.mixes:
                sel = m.check & (m.covered == m.total)
                piece_parts.append(np.full(int(sel.sum()), g + m.land, dtype=np.int64))
                want_parts.append(m.want[sel])
            g += n
        self.starts = np.array([*starts, g], dtype=np.int64)
        self.skippable = np.concatenate(ok_parts) if ok_parts else np.zeros(0, dtype=bool)
        self.nbytes = np.concatenate(nbytes) if nbytes else np.zeros(0, dtype=np.int64)
        self.unit_piece = np.concatenate(piece_parts).astype(np.int64) if piece_parts else np.zeros(0, np.int64)
        self.unit_want = np.concatenate(want_parts).astype(np.int64) if want_parts else np.zeros(0, np.int64)

    def differs(self, new: np.ndarray, old: np.ndarray) -> np.ndarray:
        """Per piece: some unit it touches has another digest in ``old`` than in ``new``."""
        bad = np.zeros(len(self.skippable), dtype=bool)
        if len(old) == len(new):
            bad[self.unit_piece[new[self.unit_want] != old[self.unit_want]]] = True
        else:  # another digest vector: nothing compares
            bad[:] = True
        return bad


def delta_index(plan: Plan) -> DeltaIndex:
    """``plan``'s delta index, built on first use and kept with it."""
    index = plan.derived.get("delta")
    if not isinstance(index, DeltaIndex):
        index = plan.derived["delta"] = DeltaIndex(plan)
    return index


@dataclass(frozen=True, slots=True)
class Skips:
    """One refit's decision: per bucket, the action of each piece and which skipped pieces are re-hashed."""

    actions: np.ndarray  # int8 per global piece: PULL, HELD or COPY
    recheck: np.ndarray  # bool per global piece
    starts: np.ndarray

    def of(self, bucket: int) -> tuple[np.ndarray | None, np.ndarray | None]:
        """(actions, recheck) of one bucket's pieces, or (None, None) when every piece is pulled."""
        a, b = int(self.starts[bucket]), int(self.starts[bucket + 1])
        actions = self.actions[a:b]
        if not actions.any():
            return None, None
        return actions, self.recheck[a:b]

    def skipped_bytes(self, index: DeltaIndex) -> int:
        return int(index.nbytes[self.actions != PULL].sum())

    def rechecked_bytes(self, index: DeltaIndex) -> int:
        return int(index.nbytes[self.recheck].sum())


Holding = tuple[object, np.ndarray]  # (digest geometry, digest vector) of the version a storage holds


def decide(
    index: DeltaIndex,
    geometry: object,
    digests: np.ndarray,
    target: Holding | None,
    live: Holding | None,
    *,
    turn: int,
    recheck_fraction: float,
) -> Skips | None:
    """Which pieces to pull, leave (``HELD``) or copy from the live storage (``COPY``); None: pull all."""
    actions = np.zeros(len(index.skippable), dtype=np.int8)
    if target is not None and target[0] == geometry:
        actions[index.skippable & ~index.differs(digests, target[1])] = HELD
    if live is not None and live is not target and live[0] == geometry:
        actions[(actions == PULL) & index.skippable & ~index.differs(digests, live[1])] = COPY
    if not actions.any():
        return None
    every = 0 if recheck_fraction <= 0 else max(1, round(1 / recheck_fraction))
    recheck = np.zeros(len(actions), dtype=bool)
    if every:
        recheck = (actions != PULL) & ((np.arange(len(actions)) + turn) % every == 0)
    return Skips(actions, recheck, index.starts)
