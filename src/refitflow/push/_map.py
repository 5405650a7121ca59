"""Map stream entries onto the receiver's parameters through canonical segments, as the plan does.

An entry is one named tensor of the sender's layout: by default (``source_layout=None``) a whole
canonical tensor named as in HF (tied aliases resolved through the model's names); with a source
layout (e.g. ``layouts.hf.layout(dims)`` for HF's fused 3-D experts) the tensor that layout names.
Its segments meet the receiver's segments (``Destination.layout``, e.g. vLLM's fused ``qkv_proj``,
``gate_up_proj``, ``w13_weight``) in canonical space, giving scatters: ``entry[sub]`` →
``param[dbox]``. The bucket becomes a plan ``Bucket`` of staged ``Piece``s over the payload, so the
pull path's translate, apply and commit stages run on it unchanged. A fused parameter's shards may
come in different buckets: coverage counts it once every box arrived.

Every check is made for a whole bucket before any byte of it is written: an unknown name, a shape
that is not the layout's, a cast nobody asked for (``PlanError``, naming the entry).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from refitflow.core.dtypes import dtype_from_name
from refitflow.core.errors import PlanError
from refitflow.layouts.boxes import full, intersect, shape_of, shift
from refitflow.layouts.canonical import LocalTensor, Segment, sliced
from refitflow.planner.pieces import check_cast
from refitflow.planner.records import Bucket, Piece, Scatter
from refitflow.push.format import Entry
from refitflow.refit.destination import Destination

__all__ = ["EntryMap"]


class EntryMap:
    """Scatters per (name, shape, dtype), computed once per receiver and reused version after version."""

    def __init__(
        self, landing: Destination, source_layout: Mapping[str, LocalTensor] | None, lossy_casts: bool
    ) -> None:
        self.landing = landing
        self.source_layout = dict(source_layout) if source_layout is not None else None
        self.lossy = lossy_casts
        self.exact = landing.layout is None  # the receiver holds whole canonical tensors
        scales, quantised = landing.scales, landing.quantised  # quantised parameters: quantised at commit
        dest = landing.layout or {
            n: sliced(n, quantised[n].format.elements(tuple(t.shape)) if n in quantised else tuple(t.shape))
            for n, t in landing.params.items()
            if n not in scales
        }
        self.index: dict[str, list[tuple[str, Segment]]] = {}  # canonical name -> (param, its segment)
        for param, lt in dest.items():
            for seg in lt.segments:
                self.index.setdefault(seg.canonical, []).append((param, seg))
        # tied aliases (one tensor, several names; whole-tensor streams only): name -> the name they share
        names: dict[str, list[str]] = {}
        for alias, first in landing.canonical.items():
            names.setdefault(first, []).append(alias)
        tied = {a: first for first, aliases in names.items() if len(aliases) > 1 for a in aliases}
        self.tied = tied if source_layout is None else {}
        self._cache: dict[tuple[str, tuple[int, ...], str], tuple[Scatter, ...]] = {}
        self.misses = 0  # entries mapped anew (none: the stream's layout was seen before)

    def scatters(self, e: Entry, version: int) -> tuple[Scatter, ...]:
        key = (e.name, e.shape, e.dtype)
        found = self._cache.get(key)
        if found is None:
            self.misses += 1
            found = self._cache[key] = self._scatters(e, version)
        return found

    def _scatters(self, e: Entry, version: int) -> tuple[Scatter, ...]:
        if self.source_layout is not None:
            local = self.source_layout.get(e.name)
            if local is None:
                raise PlanError("the source layout has no tensor of this name", tensor=e.name, version=version)
            if local.shape != e.shape:
                raise PlanError(f"shape mismatch: stream {e.shape}, source layout {local.shape}", tensor=e.name,
                                version=version)  # fmt: skip
        else:
            local = sliced(self.landing.canonical.get(e.name, e.name), e.shape)
        src = dtype_from_name(e.dtype, tensor=e.name)
        if src in (torch.float8_e4m3fn, torch.float8_e5m2):  # values without their scales: no number to land
            raise PlanError("the push stream carries unquantised tensors only; publish quantised pairs with "
                            "rf.Publisher (docs/quant.md)", tensor=e.name, version=version)  # fmt: skip
        out: list[Scatter] = []
        for sseg in local.segments:
            targets = self.index.get(sseg.canonical)
            if not targets:
                raise PlanError(f"the model has no parameter named {sseg.canonical!r}", tensor=e.name, version=version)
            for param, dseg in targets:
                if self.source_layout is None and not _inside(dseg.cbox, sseg.cbox, self.exact):
                    raise PlanError(
                        f"shape mismatch: stream {e.shape}, model needs {shape_of(dseg.cbox)} of {sseg.canonical}",
                        tensor=e.name, version=version,
                    )  # fmt: skip
                common = intersect(sseg.cbox, dseg.cbox)
                if common is None:
                    continue
                dst = torch.float32 if param in self.landing.quantised else self.landing.params[param].dtype
                check_cast(src, dst, self.lossy, e.name)
                out.append(Scatter(param, shift(common, sseg.cbox, sseg.lbox), shift(common, dseg.cbox, dseg.lbox)))
        return tuple(out)

    def bucket(
        self, index: int, entries: list[Entry], payload_bytes: int, version: int, tied: dict[str, str], device: str
    ) -> Bucket:
        """The bucket as staged pieces over the payload; every entry checked before it is returned.

        ``tied``: tied tensor -> the first of its names this stream carried; the same tensor under
        another name later is the same bytes (a state dict lists both): written once, as the pull
        path reads it once. ``device``: where the payload lands (the group's device).
        """
        scatters = [self.scatters(e, version) for e in entries]
        pieces = []
        for e, sc in zip(entries, scatters, strict=True):
            first = self.tied.get(e.name)
            if (first is not None and tied.setdefault(first, e.name) != e.name) or not sc:
                continue
            piece = Piece(
                source=0, tensor=e.name, src_dtype=e.dtype, box=full(e.shape), first=0, run=math.prod(e.shape),
                stride=0, count=1, src_region=0, src_offset=e.offset, nbytes=e.nbytes, direct=False,
                landing_offset=e.offset, scatters=sc, device=device,
            )  # fmt: skip
            pieces.append(piece)
        touched = {str(self.landing.params[s.param].device) for p in pieces for s in p.scatters}
        devices = (device, *sorted(touched - {device}))
        return Bucket(index, tuple(pieces), (), staging_bytes=payload_bytes, direct_bytes=0, device=device,
                      devices=devices, staged=tuple(pieces), pulled_bytes=payload_bytes)  # fmt: skip


def _inside(need: tuple, held: tuple, exact: bool) -> bool:
    """A whole streamed tensor holds every box the model needs of it (exactly it, for whole parameters)."""
    if len(need) != len(held):
        return False
    if exact:
        return need == held
    return all(h0 <= n0 and n1 <= h1 for (n0, n1), (h0, h1) in zip(need, held, strict=True))
