"""The READs a ``NixlTransport`` has described and prepared, kept by read key for every replay of them.

A read ``key`` is a caller's name for a list of reads it issues again with the same ranges: a refit's is
``(plan serial, bucket, ...)``. Keys are kept by *group*, a key's first element (the plan): everything prepared
for a group stays until the group is forgotten (``Transport.forget``: a receiver forgets a plan when its plan
cache drops it), so a plan of thousands of buckets replays without preparing a READ again — an LRU of buckets
smaller than a plan would prepare every bucket of every refit. At most ``groups`` groups are kept (the least
recently used dropped) for callers that never forget.

What invalidates a preparation is exactly what it touched: a local region deregistered (``forget_local``:
storage moved, a receiver rebound) drops the READs that land in it and no other; a peer whose address changed
or that was replaced drops that peer's READs (``forget``).

A key read from peer after peer (a relay reader whose relay changes from version to version) keeps the
preparations of the peers of its ``PEERS`` most recent reads only (``read_from``; a read of several peers at once
keeps them all): a prepared descriptor holds ≈ 145 bytes here (``bench/prepared_memory.py``), and a reader that
kept every relay it ever read would hold its relayed descriptors once a relay. Letting one go makes every kept
batch stale (``_generation``): the next replay of each key looks its transfers up again, once.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import numpy as np

from refitflow.core.errors import TransportError
from refitflow.transports._nixl_agent import LockedAgent
from refitflow.transports._nixl_descs import Described
from refitflow.transports._nixl_state import CacheKey, _Prepared
from refitflow.transports.base import Read

__all__ = ["PreparedReads", "announce", "ended", "group_of", "release", "submitted"]

VARIANTS = 2  # prepared variants kept per key: shadow mode alternates between two landing storages
PEERS = 2  # peer sets whose preparations a key keeps: a relay reader's relay now and its last one


def group_of(key: Hashable) -> Hashable:
    """A read key's group: its first element when it is a tuple, else the key itself."""
    return key[0] if isinstance(key, tuple) and key else key


class PreparedReads:
    def __init__(self, groups: int = 16) -> None:
        self._groups: OrderedDict[Hashable, dict[CacheKey, list[_Prepared]]] = OrderedDict()
        # by group: each read key's sets of peers read together (a batch's), the least recently read first, and
        # the cache keys prepared for each (key, peer)
        self._peer_sets: dict[Hashable, dict[Hashable, OrderedDict[frozenset[str], None]]] = {}
        self._of_peer: dict[Hashable, dict[tuple[Hashable, str], set[CacheKey]]] = {}
        # key -> (the very reads list described, peers' epochs, its description), by group
        self._described: OrderedDict[Hashable, dict[Hashable, tuple[Sequence[Read], Any, Described]]] = OrderedDict()
        # key -> (the very reads list, peers' state, generation, its batch and cache keys): a replay's whole answer
        self._batches: dict[Hashable, tuple[Sequence[Read], Any, int, Any]] = {}
        self._generation = 0  # bumped whenever a kept preparation is released: every batch made before is stale
        self._limit = groups
        self.prepared = 0  # preparations made (a replay makes none)

    # -- descriptions -------------------------------------------------------------------------------------

    def described(self, key: Hashable, reads: Sequence[Read], state: Any) -> Described | None:
        """The description of ``reads`` made under ``key`` for this very list object and peer state, if any."""
        found = self._described.get(group_of(key), {}).get(key)
        if found is not None and found[0] is reads and found[1] == state:
            return found[2]
        return None

    def remember(self, key: Hashable, reads: Sequence[Read], state: Any, described: Described) -> None:
        self._touch(self._described, group_of(key))[key] = (reads, state, described)

    def batch(self, key: Hashable, reads: Sequence[Read], state: Any) -> Any:
        """The batch ``remember_batch`` kept for this very list object under ``key``, if the peers' state is the
        same and no kept preparation was released since (else None)."""
        found = self._batches.get(key)
        if found is not None and found[0] is reads and found[1] == state and found[2] == self._generation:
            return found[3]
        return None

    def remember_batch(self, key: Hashable, reads: Sequence[Read], state: Any, batch: Any) -> None:
        self._batches[key] = (reads, state, self._generation, batch)

    # -- preparations -------------------------------------------------------------------------------------

    def lookup(self, ckey: CacheKey | None, epoch: int, larr: np.ndarray, rarr: np.ndarray) -> _Prepared | None:
        """The transfer prepared under ``ckey`` for these exact arrays and the peer's current ``epoch``, if any."""
        if ckey is None:
            return None
        for p in self._groups.get(group_of(ckey[0]), {}).get(ckey, ()):
            same = (p.larr is larr and p.rarr is rarr) or (
                np.array_equal(p.larr, larr) and np.array_equal(p.rarr, rarr)
            )
            if p.epoch == epoch and same:
                return p
        return None

    def prepare(
        self, ckey: CacheKey | None, nx: LockedAgent, peer: str, lmem: str, rmem: str, larr: np.ndarray,
        rarr: np.ndarray, epoch: int, regions: frozenset[int],
    ) -> _Prepared:  # fmt: skip
        """The transfer prepared under ``ckey`` for these exact arrays, or a freshly prepared one (kept under
        ``ckey``; ``regions``: the local regions it lands in)."""
        hit = self.lookup(ckey, epoch, larr, rarr)
        if hit is not None:
            return hit
        handles: list[Any] = []
        try:
            with nx.lock, nx.translated("descriptor preparation"):
                handles.append(nx.agent.prep_xfer_dlist("NIXL_INIT_AGENT", larr, lmem))
                handles.append(nx.agent.prep_xfer_dlist(peer, rarr, rmem))
                idx = np.arange(len(larr), dtype=np.int64)
                handles.append(nx.agent.make_prepped_xfer("READ", handles[0], idx, handles[1], idx))
        except BaseException:
            release(_Prepared(larr, rarr, epoch, regions, nx, tuple(handles)))
            raise
        self.prepared += 1
        prepared = _Prepared(larr, rarr, epoch, regions, nx, tuple(handles))
        if ckey is not None:
            kept = self._touch(self._groups, group_of(ckey[0]))
            variants = [*kept.get(ckey, []), prepared]
            for old in variants[:-VARIANTS]:
                self._release(old)
            kept[ckey] = variants[-VARIANTS:]
            self._of_peer.setdefault(group_of(ckey[0]), {}).setdefault((ckey[0], peer), set()).add(ckey)
        return prepared

    def read_from(self, key: Hashable, peers: frozenset[str]) -> None:
        """``key``'s reads were just described for ``peers`` (a batch's: a bucket may read several trainer ranks
        at once); the peers of its ``PEERS`` most recent peer sets keep their preparations, any other's go."""
        group = group_of(key)
        sets = self._peer_sets.setdefault(group, {}).setdefault(key, OrderedDict())
        sets[peers] = None
        sets.move_to_end(peers)
        if len(sets) <= PEERS:
            return
        gone = sets.popitem(last=False)[0].difference(*sets)
        kept, of_peer = self._groups.get(group, {}), self._of_peer.get(group, {})
        for peer in gone:
            for ckey in of_peer.pop((key, peer), ()):
                for old in kept.pop(ckey, ()):
                    self._release(old)

    @property
    def kept(self) -> int:
        """Preparations kept for replay now (each holds NIXL descriptor lists)."""
        return sum(len(v) for kept in self._groups.values() for v in kept.values())

    # -- forgetting -----------------------------------------------------------------------------------

    def forget_group(self, group: Hashable) -> None:
        """Everything prepared and described under ``group``'s keys."""
        for variants in self._groups.pop(group, {}).values():
            for p in variants:
                self._release(p)
        self._peer_sets.pop(group, None)
        self._of_peer.pop(group, None)
        self._described.pop(group, None)
        for key in [k for k in self._batches if group_of(k) == group]:
            del self._batches[key]

    def forget(self, match: Callable[[CacheKey], bool]) -> None:
        """The preparations whose cache key ``match``es (their descriptions stay: they name no NIXL handle)."""
        for kept in self._groups.values():
            for ckey in [k for k in kept if match(k)]:
                for p in kept.pop(ckey):
                    self._release(p)

    def forget_local(self, region: int) -> None:
        """What lands in local ``region`` (deregistered): its preparations and descriptions, and nothing else."""
        for kept in self._groups.values():
            for ckey, variants in list(kept.items()):
                gone = [p for p in variants if region in p.regions]
                for p in gone:
                    self._release(p)
                if gone:
                    left = [p for p in variants if region not in p.regions]
                    if left:
                        kept[ckey] = left
                    else:
                        del kept[ckey]
        for described in self._described.values():
            for key in [k for k, (_, _, d) in described.items() if any(region in g.regions for g in d.values())]:
                del described[key]

    def clear(self) -> None:
        for group in list(self._groups):
            self.forget_group(group)
        self._described.clear()
        self._batches.clear()

    def _release(self, prepared: _Prepared) -> None:
        self._generation += 1
        release(prepared)

    def _touch(self, table: OrderedDict[Hashable, Any], group: Hashable) -> Any:
        """``table``'s entry for ``group``, made if new, the most recently used; the least recent past the limit
        forgotten."""
        entry = table.get(group)
        if entry is None:
            entry = table[group] = {}
            while len(table) > self._limit:
                oldest = next(iter(table))
                if table is self._groups:
                    self.forget_group(oldest)
                else:
                    del table[oldest]
        table.move_to_end(group)
        return entry


def release(prepared: _Prepared) -> None:
    """Release a preparation's NIXL handles — once none of its READs is in flight (a poster thread still checks a
    submitted one: released under it, NIXL would touch freed memory); idempotent."""
    if prepared.busy:
        prepared.doomed = True  # ``ended`` releases it
        return
    handles, prepared.handles = prepared.handles, ()
    for h in reversed(handles):
        try:
            with prepared.nx.lock, prepared.nx.translated("handle release"):
                h.release()
        except TransportError:
            pass  # e.g. a transfer to a dead peer that cannot be cancelled: nothing more to do


def announce(batch: list[tuple[_Prepared, str]]) -> None:
    """Tell each agent's peers in ``batch`` (transfers and the peer each reads) that a read is coming."""
    peers: dict[int, tuple[LockedAgent, set[str]]] = {}
    for p, peer in batch:
        peers.setdefault(id(p.nx), (p.nx, set()))[1].add(peer)
    for nx, each in peers.values():
        nx.announce(each)


def submitted(prepared: _Prepared) -> None:
    """A READ of ``prepared`` was handed to a poster thread."""
    prepared.busy += 1


def ended(prepared: _Prepared) -> None:
    """A READ of ``prepared`` ended; released meanwhile, its handles go now."""
    prepared.busy -= 1
    if prepared.doomed and not prepared.busy:
        release(prepared)
