"""Run a route's jobs (``planner/routes.py``) once every assembly they need is complete: quantise, copy
exactly, or dequantise (then cast or quantise again), on the parameters' device, into the target storage."""

from __future__ import annotations

import torch

from refitflow.layouts.boxes import Box, full, shape_of, shift
from refitflow.layouts.quant import QuantParam
from refitflow.layouts.quant_layout import aligned_scale_box
from refitflow.layouts.quant_math import dequantize, encode_scales, quantize
from refitflow.planner.build import box_index as _at
from refitflow.planner.routes import Job
from refitflow.refit.destination import Destination

__all__ = ["run_job"]


def _within(box: Box, outer: Box) -> Box:
    """``box`` relative to the origin of ``outer`` (which holds it)."""
    return shift(box, outer, full(shape_of(outer)))


def store(landing: Destination, q: QuantParam, x: torch.Tensor) -> None:
    """Quantise float32 elements ``x`` into ``q``'s values, scales and global scale."""
    values, scales, g = quantize(q.format, x)
    landing.target(q.values).copy_(values)
    landing.target(q.scale).copy_(encode_scales(q.format, scales, values.shape[-2]))
    if q.global_ is not None:
        assert g is not None
        out = landing.target(q.global_)
        out.copy_(g.reshape(out.shape))


def run_job(landing: Destination, job: Job) -> None:
    if not job.parts:  # quantise what was published unquantised
        assert job.quant is not None
        store(landing, job.quant, landing.release_assembly(job.param))
        return
    aux = {name: landing.release_assembly(name) for name, _ in job.needs}
    if job.exact:
        _copy(landing, job, aux)
        return
    buf = landing.assembly(job.param) if job.quant is not None else landing.target(job.param)
    for p in job.parts:
        v = aux[p.values]
        if p.fmt is None:
            x, cover = v.float(), p.cover
        else:
            assert p.scale is not None
            x = dequantize(p.fmt, v, aux[p.scale], aux[p.global_] if p.global_ else None)
            (a, b), pv = p.cover[-1], p.fmt.per_value
            cover = (*p.cover[:-1], (a * pv, b * pv))
        buf[_at(p.lbox)].copy_(x[_at(_within(p.cbox, cover))].reshape(shape_of(p.lbox)))
    if job.quant is not None:
        store(landing, job.quant, landing.release_assembly(job.param))


def _copy(landing: Destination, job: Job, aux: dict[str, torch.Tensor]) -> None:
    """The same numbers, whole blocks on both sides: values copied, scales re-stored in the parameter's way."""
    q = job.quant
    assert q is not None
    fmt, values = q.format, landing.target(job.param)
    scales = torch.empty(fmt.scale_shape(tuple(values.shape)), dtype=fmt.scale, device=values.device)
    for p in job.parts:
        assert p.scale is not None
        rel = _within(p.cbox, p.cover)
        values[_at(p.lbox)].copy_(aux[p.values][_at(rel)].reshape(shape_of(p.lbox)))
        src = aligned_scale_box(fmt, rel, shape_of(p.cover))
        dst = aligned_scale_box(fmt, p.lbox, tuple(values.shape))
        assert src is not None and dst is not None  # an exact job has whole blocks
        scales[_at(dst)].copy_(aux[p.scale][_at(src)].reshape(shape_of(dst)))
    landing.target(q.scale).copy_(encode_scales(fmt, scales, values.shape[-2]))
    if q.global_ is not None:
        out = landing.target(q.global_)
        out.copy_(aux[job.parts[0].global_ or ""].reshape(out.shape))
