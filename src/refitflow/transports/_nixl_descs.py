"""Descriptor arithmetic for the NIXL transport: region tables, the address format, coalescing.

Pure data and numpy; nothing here touches NIXL, so it is cheap to test and import. A source's
``SourceAddress.metadata`` is ``MAGIC | u32 table length | JSON region table | NIXL agent metadata``:
the table maps each region id to its address, length, device ordinal and memory type, so a reader
can turn ``(region, offset)`` into a remote descriptor.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import orjson

from refitflow.core.errors import TransportError
from refitflow.transports.base import Read

__all__ = [
    "DescGroup", "Described", "LocalIndex", "RegionInfo", "coalesce", "describe", "descs", "pack_address", "stripe",
    "unpack_address",
]  # fmt: skip

MAGIC = b"RFNIXL1\n"
MEM_TYPES = ("DRAM", "VRAM")


@dataclass(frozen=True, slots=True)
class RegionInfo:
    addr: int
    nbytes: int
    devid: int
    mem: str  # "DRAM" | "VRAM"


class DescGroup(NamedTuple):
    """One (peer, local memory, remote memory) group of described reads: coalesced Nx3 descriptor arrays, and
    the local regions they land in."""

    larr: np.ndarray
    rarr: np.ndarray
    regions: frozenset[int]


Described = dict[tuple[str, str, str], DescGroup]  # (peer, local mem, remote mem) -> its reads


def pack_address(regions: Mapping[int, RegionInfo], agent_md: bytes) -> bytes:
    table = orjson.dumps([[rid, r.addr, r.nbytes, r.devid, r.mem] for rid, r in sorted(regions.items())])
    return MAGIC + struct.pack("<I", len(table)) + table + agent_md


def unpack_address(data: bytes) -> tuple[dict[int, RegionInfo], bytes]:
    """The region table and the NIXL agent metadata of a packed address."""
    head = len(MAGIC) + 4
    if not data.startswith(MAGIC) or len(data) < head:
        raise TransportError("not a refitflow NIXL address (bad magic)")
    (size,) = struct.unpack_from("<I", data, len(MAGIC))
    try:
        rows = orjson.loads(data[head : head + size])
        regions = {int(rid): RegionInfo(int(a), int(n), int(d), str(m)) for rid, a, n, d, m in rows}
    except (orjson.JSONDecodeError, TypeError, ValueError) as exc:
        raise TransportError(f"malformed NIXL address region table: {exc}") from exc
    if any(r.mem not in MEM_TYPES for r in regions.values()):
        raise TransportError("NIXL address names an unknown memory type")
    md = data[head + size :]
    if not md:
        raise TransportError("NIXL address carries no agent metadata")
    return regions, md


class LocalIndex:
    """This agent's registered regions, sorted by address, for vectorised lookups of landing buffers."""

    def __init__(self, regions: Mapping[int, RegionInfo]) -> None:
        items = sorted(((r.addr, rid, r) for rid, r in regions.items() if r.nbytes), key=lambda x: x[0])
        self.ids = np.array([rid for _, rid, _ in items], dtype=np.int64)
        self.starts = np.array([a for a, _, _ in items], dtype=np.uint64)
        self.ends = np.array([a + r.nbytes for a, _, r in items], dtype=np.uint64)
        self.infos = [r for _, _, r in items]

    def locate(self, addrs: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
        """Positions (into ``infos``) of the region holding each ``[addr, addr + nbytes)``.

        Overlapping registrations (views of one buffer) are resolved by a slow scan for the few
        ranges the nearest-start guess does not hold. Raises ``TransportError`` for unregistered memory.
        """
        if not len(self.starts):
            raise TransportError("no local memory is registered")
        pos = np.searchsorted(self.starts, addrs, side="right").astype(np.int64) - 1
        clipped = np.clip(pos, 0, None)
        ok = (pos >= 0) & (addrs + nbytes <= self.ends[clipped])
        for i in np.flatnonzero(~ok):
            a, n = int(addrs[i]), int(nbytes[i])
            hits = [k for k, r in enumerate(self.infos) if r.addr <= a and a + n <= r.addr + r.nbytes]
            if not hits:
                raise TransportError(f"local buffer [{a:#x}, +{n}) is not inside registered memory")
            clipped[i] = hits[0]
        return clipped


def coalesce(
    laddr: np.ndarray, raddr: np.ndarray, nbytes: np.ndarray, lkey: np.ndarray, rkey: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Merge reads that continue each other on both sides inside one local and one remote region.

    Returns the merged local addresses, remote addresses, lengths, and the index of each merged
    range's first read.
    """
    if len(laddr) <= 1:
        return laddr, raddr, nbytes, np.zeros(len(laddr), dtype=np.int64)
    cont = (
        (laddr[:-1] + nbytes[:-1] == laddr[1:])
        & (raddr[:-1] + nbytes[:-1] == raddr[1:])
        & (lkey[:-1] == lkey[1:])
        & (rkey[:-1] == rkey[1:])
    )
    starts = np.flatnonzero(np.concatenate(([True], ~cont)))
    return laddr[starts], raddr[starts], np.add.reduceat(nbytes, starts), starts


def descs(addrs: np.ndarray, nbytes: np.ndarray, devids: np.ndarray | Sequence[int]) -> np.ndarray:
    """An Nx3 uint64 descriptor array (addr, len, devid), as NIXL takes it."""
    out = np.empty((len(addrs), 3), dtype=np.uint64)
    out[:, 0] = addrs
    out[:, 1] = nbytes
    out[:, 2] = devids
    return out


def describe(
    reads: Sequence[Read], regions_of: Mapping[str, Mapping[int, RegionInfo]], index: LocalIndex
) -> Described:
    """Per (peer, local mem, remote mem): coalesced local and remote Nx3 descriptor arrays of ``reads``, and the
    local regions they land in.

    One Python pass over the reads (validation and addresses), the rest in numpy; a strided read
    expands to one descriptor per run here.
    """
    n = len(reads)
    rows: list[
        tuple[int, int, int, int, int, int, int]
    ] = []  # remote addr, region, devid, local addr, nbytes, stride, count
    groups: dict[tuple[str, str], list[int]] = {}
    for i, r in enumerate(reads):
        regions = regions_of.get(r.peer)
        info = None if regions is None else regions.get(r.region)
        if info is None:
            why = "is not connected" if regions is None else f"has no region {r.region}"
            raise TransportError(f"nixl peer {r.peer!r} {why}")
        if r.low < 0 or r.low + r.extent > info.nbytes or r.dst.nbytes != r.total:
            raise TransportError(f"read [{r.low}, +{r.extent}) outside region {r.region} of {r.peer!r}")
        rows.append((info.addr + r.offset, r.region, info.devid, r.dst.data_ptr(), r.nbytes, r.stride, r.count))
        groups.setdefault((r.peer, info.mem), []).append(i)
    table = np.array(rows, dtype=np.int64).reshape(n, 7)  # addresses fit: user space is below 2**63
    stride = table[:, 5].copy()  # signed (runs downwards)
    raddr, rkey, rdev, laddr, nbytes, _, count = table.astype(np.uint64).T
    lpos = index.locate(laddr, nbytes * count) if n else np.empty(0, dtype=np.int64)
    ldev = np.array([i.devid for i in index.infos], dtype=np.uint64)[lpos]
    lvram = np.array([i.mem == "VRAM" for i in index.infos], dtype=bool)[lpos]
    out = {}
    for (agent, rmem), members in groups.items():
        idx = np.asarray(members, dtype=np.int64)
        for lmem, sel in (("DRAM", idx[~lvram[idx]]), ("VRAM", idx[lvram[idx]])):
            if len(sel):
                la, ra, nb, lk, rk, ld, rd = _expand(laddr[sel], raddr[sel], nbytes[sel], stride[sel], count[sel],
                                                     lpos[sel], rkey[sel], ldev[sel], rdev[sel])  # fmt: skip
                la, ra, nb, first = coalesce(la, ra, nb, lk, rk)
                lands = frozenset(index.ids[np.unique(lpos[sel])].tolist())
                out[(agent, lmem, rmem)] = DescGroup(descs(la, nb, ld[first]), descs(ra, nb, rd[first]), lands)
    return out


def _expand(
    laddr: np.ndarray, raddr: np.ndarray, nbytes: np.ndarray, stride: np.ndarray, count: np.ndarray, *keys: np.ndarray
) -> tuple[np.ndarray, ...]:
    """One entry per run: a strided read's runs land back to back locally, ``stride`` apart remotely
    (``stride`` signed: runs downwards from the first)."""
    if not len(count) or int(count.max()) <= 1:
        return (laddr, raddr, nbytes, *keys)
    reps = count.astype(np.int64)
    starts = np.cumsum(reps) - reps
    k = np.arange(int(reps.sum()), dtype=np.int64) - np.repeat(starts, reps)
    nb = np.repeat(nbytes, reps)
    remote = (np.repeat(raddr.astype(np.int64), reps) + k * np.repeat(stride, reps)).astype(np.uint64)
    return (np.repeat(laddr, reps) + k.astype(np.uint64) * nb, remote, nb,
            *(np.repeat(x, reps) for x in keys))  # fmt: skip


def stripe(larr: np.ndarray, rarr: np.ndarray, k: int, min_bytes: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Cut a descriptor pair list into ``k`` parts of (nearly) equal bytes, splitting ranges at the cuts.

    Fewer than ``k * min_bytes`` bytes stay in one part.
    """
    sizes = larr[:, 1]
    total = int(sizes.sum())
    if k <= 1 or total < k * min_bytes:
        return [(larr, rarr)]
    starts = np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.uint64)
    bounds = (np.arange(1, k, dtype=np.uint64) * np.uint64(total)) // np.uint64(k) & ~np.uint64(4095)
    cuts = np.union1d(starts, bounds)  # every segment start: a range's start or a stripe boundary
    ends = np.append(cuts[1:], np.uint64(total))
    idx = np.searchsorted(starts, cuts, side="right") - 1
    off = cuts - starts[idx]
    parts = []
    which = np.searchsorted(bounds, cuts, side="right")
    for arr in (larr, rarr):
        seg = arr[idx].copy()
        seg[:, 0] += off
        seg[:, 1] = ends - cuts
        parts.append(seg)
    return [(parts[0][which == j], parts[1][which == j]) for j in range(k)]
