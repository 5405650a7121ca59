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

import numpy as np
import orjson

from refitflow.core.errors import TransportError

__all__ = ["LocalIndex", "RegionInfo", "coalesce", "descs", "pack_address", "unpack_address"]

MAGIC = b"RFNIXL1\n"
MEM_TYPES = ("DRAM", "VRAM")


@dataclass(frozen=True, slots=True)
class RegionInfo:
    addr: int
    nbytes: int
    devid: int
    mem: str  # "DRAM" | "VRAM"


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
