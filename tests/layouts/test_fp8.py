"""FP8 destinations: per-block (128×128) quantisation with the scale tensor written alongside."""

from __future__ import annotations

import contextlib

import anyio
import pytest
import torch

import refitflow as rf
from refitflow.layouts import Parallel, canonical_shapes, fused, hf, megatron
from refitflow.layouts.canonical import from_canonical, to_canonical
from refitflow.layouts.wire import layout_metadata
from tests.layouts._fp8 import dequantize, scale_name, scale_shape
from tests.layouts._models import _logits, _model


def _fp8(name: str) -> bool:
    return ".layers." in name and name.endswith("proj.weight")


@pytest.mark.asyncio
async def test_fp8_ranks_hold_quantised_weights_within_the_error_bound() -> None:
    trainer = _model("llama", 2)
    d = hf.dims_from_config(trainer.config)
    canon = to_canonical([(hf.layout(d), trainer.state_dict())], canonical_shapes(d))
    registry, ident = rf.Registry(), rf.Identity(model="tiny", layout="megatron")
    maps = [fused.layout(d, Parallel(tp=2, tp_rank=r)) for r in range(2)]
    ranks = []
    for m in maps:
        tensors = {}
        for n, lt in m.items():
            tensors[n] = torch.zeros(lt.shape, dtype=torch.float8_e4m3fn if _fp8(n) else torch.float32)
            if _fp8(n):
                tensors[scale_name(n)] = torch.zeros(scale_shape(lt.shape))
        ranks.append(tensors)
    with anyio.fail_after(30):
        async with contextlib.AsyncExitStack() as stack:
            for r in range(2):
                p = Parallel(tp=2, tp_rank=r)
                meta = layout_metadata("megatron", d, p)
                pub = await stack.enter_async_context(
                    rf.Publisher(registry, identity=ident, rank=r, world_size=2, metadata=meta)
                )
                await pub.publish(1, from_canonical(megatron.layout(d, p), canon))
            for m, tensors in zip(maps, ranks, strict=True):
                async with rf.Receiver(tensors, registry, identity=ident, layout=m, budget_bytes=8192) as recv:
                    await recv.refit(1)
    deq = []
    for m, tensors in zip(maps, ranks, strict=True):
        out = {}
        for n in m:
            if _fp8(n):
                q, s = tensors[n], tensors[scale_name(n)]
                assert s.min() > 0  # every block got its scale
                out[n] = dequantize(q, s)
                want = from_canonical({n: m[n]}, canon)[n].float()
                # e4m3: 3 mantissa bits, so |x - q·s| ≤ max(|x|·2^-4, s·2^-10) elementwise
                scale = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[: q.shape[0], : q.shape[1]]
                bound = torch.maximum(want.abs() * 2**-4, scale * 2**-10) * (1 + 1e-6)
                assert ((out[n] - want).abs() <= bound).all(), n
            else:
                out[n] = tensors[n]
        deq.append(out)
    fresh = _model("llama", 2, seed=1).float()
    fresh.load_state_dict(
        from_canonical(hf.layout(d), to_canonical(list(zip(maps, deq, strict=True)), canonical_shapes(d)))
    )
    got, want = _logits(fresh), _logits(trainer.float())
    # first order: each of the 8 quantised matmuls on the path adds at most 2^-4 relative error
    rel = ((got - want).norm() / want.norm()).item()
    assert not torch.equal(got, want) and rel < 8 * 2**-4, rel


def test_a_float8_parameter_without_its_scale_is_refused() -> None:
    with pytest.raises(rf.ConfigError, match="needs a float32 'w_scale_inv' of shape \\(1, 1\\)"):
        rf.Receiver({"w": torch.zeros(4, 4, dtype=torch.float8_e4m3fn)}, rf.Registry(), identity=rf.Identity(model="m"))


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", ["in_place", "shadow"])
async def test_delta_refits_leave_unchanged_boxes_and_always_pull_float8_ones(mode: str) -> None:
    """Megatron TP2 bf16 into fused TP2 ranks holding bf16 and float8 tensors; the same bytes published
    again: every bf16 box is left (and re-hashed where it lies), every float8 one pulled and quantised."""
    trainer = _model("llama", 2)
    d = hf.dims_from_config(trainer.config)
    canon = to_canonical([(hf.layout(d), trainer.state_dict())], canonical_shapes(d))
    registry, ident = rf.Registry(), rf.Identity(model="tiny", layout="megatron")
    places = [Parallel(tp=2, tp_rank=r) for r in range(2)]
    maps = [fused.layout(d, p) for p in places]
    ranks = []
    for m in maps:
        tensors = {n: torch.zeros(lt.shape, dtype=torch.float8_e4m3fn if _fp8(n) else torch.bfloat16)
                   for n, lt in m.items()}  # fmt: skip
        tensors |= {scale_name(n): torch.zeros(scale_shape(lt.shape)) for n, lt in m.items() if _fp8(n)}
        ranks.append(tensors)
    seen = []
    with anyio.fail_after(30):
        async with contextlib.AsyncExitStack() as stack:
            pubs = [await stack.enter_async_context(rf.Publisher(
                registry, identity=ident, rank=r, world_size=2, metadata=layout_metadata("megatron", d, p)
            )) for r, p in enumerate(places)]  # fmt: skip
            recvs = [await stack.enter_async_context(rf.Receiver(
                t, registry, identity=ident, layout=m, budget_bytes=8192, mode=mode, recheck_fraction=1.0
            )) for m, t in zip(maps, ranks, strict=True)]  # fmt: skip
            for v in (1, 2):
                for pub, p in zip(pubs, places, strict=True):
                    await pub.publish(v, from_canonical(megatron.layout(d, p), canon))
                results = [await r.refit(v) for r in recvs]
                seen.append([{n: t.view(torch.uint8).clone() for n, t in tensors.items()} for tensors in ranks])
    fp8_bytes = [sum(t.nbytes for n, t in tensors.items() if t.dtype == torch.float8_e4m3fn) for tensors in ranks]
    for r, result in enumerate(results):
        assert result.skipped_bytes == result.rechecked_bytes > 0 and result.repaired_bytes == 0
        assert result.nbytes == 2 * fp8_bytes[r]  # the bf16 bytes of every float8 tensor, read again
        assert all(torch.equal(seen[0][r][n], seen[1][r][n]) for n in ranks[r])
