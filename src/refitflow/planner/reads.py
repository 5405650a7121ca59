"""Reads: the planned reads of pieces, and reads that continue each other merged.

A piece is one read of its trainer source (``piece_read``); a bucket's reads, in landing order, are merged
where one continues the previous one where it lands (``coalesce``): into one run when the sources continue too,
else into one strided read when their runs keep one step — neighbouring tensors of one trainer buffer, the
step negative where the buffer holds them last first (Megatron's DDP buffers); transports expand a strided
read into one descriptor per run.
"""

from __future__ import annotations

from collections.abc import Iterator

from refitflow.planner.records import Piece, PlannedRead

__all__ = ["coalesce", "piece_read", "runs_read"]


def piece_read(p: Piece) -> PlannedRead:
    """The one read of a piece from its trainer source (runs back to back become one run)."""
    item = p.nbytes // max(p.run * p.count, 1)
    return runs_read(p.source, p.src_region, p.src_offset + p.first * item, p.run * item, p.stride * item, p.count,
                     p.scatters[0].param if p.direct else None, p.landing_offset)  # fmt: skip


def runs_read(
    source: int, region: int, src: int, n: int, stride: int, count: int, param: str | None, at: int
) -> PlannedRead:
    """``count`` runs of ``n`` bytes ``stride`` apart as one planned read (one run when back to back)."""
    if count > 1 and stride == n:
        n, count = n * count, 1
    return PlannedRead(source, region, src, n, param, at, stride if count > 1 else 0, count)


def coalesce(reads: Iterator[PlannedRead] | list[PlannedRead]) -> list[PlannedRead]:
    """Reads in landing order, each that continues the previous one where it lands merged into it: one
    run when the sources continue too, else runs of equal size a constant step apart (neighbouring
    tensors of one trainer buffer — a step down where the buffer holds them in reverse, as Megatron's
    DDP buffers do a layer's experts)."""
    out: list[PlannedRead] = []
    for r in reads:
        prev = out[-1] if out else None
        if (
            prev is None or (prev.source, prev.region, prev.param) != (r.source, r.region, r.param)
            or prev.landing_offset + prev.nbytes * prev.count != r.landing_offset
        ):  # fmt: skip
            out.append(r)
        elif r.count == 1 and prev.count == 1 and prev.src_offset + prev.nbytes == r.src_offset:
            out[-1] = PlannedRead(prev.source, prev.region, prev.src_offset, prev.nbytes + r.nbytes, prev.param,
                                  prev.landing_offset)  # fmt: skip
        elif (merged := _continued(prev, r)) is not None:
            out[-1] = merged
        else:
            out.append(r)
    return out


def _continued(prev: PlannedRead, r: PlannedRead) -> PlannedRead | None:
    """``prev`` and ``r`` (landing back to back) as one strided read, if their runs keep one step."""
    if r.nbytes != prev.nbytes:
        return None
    step = prev.stride if prev.count > 1 else r.src_offset - prev.src_offset
    if abs(step) < r.nbytes or (r.count > 1 and r.stride != step):  # overlapping runs: read apart
        return None
    if r.src_offset != prev.src_offset + prev.count * step:
        return None
    return PlannedRead(prev.source, prev.region, prev.src_offset, prev.nbytes, prev.param, prev.landing_offset, step,
                       prev.count + r.count)  # fmt: skip
