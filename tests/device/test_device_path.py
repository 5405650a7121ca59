"""The device path end to end: publisher and receiver tensors on ``--device`` (cpu here, cuda on a GPU).

Every test runs unchanged on CPU and CUDA; with ``--device cpu`` the "device" and "host" sides of a
mixed placement are the same CPU, so those cases then check the CPU path only.
"""

from __future__ import annotations

import anyio
import pytest
import torch

import refitflow as rf
from tests.conftest import mlp
from tests.layouts._fp8 import dequantize

MODES = [("in_place", "swap"), ("shadow", "swap"), ("shadow", "copy")]


def _on(model: torch.nn.Module, device: torch.device | str) -> torch.nn.Module:
    return model.to(device)


def _values(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters()}


def _devices(model: torch.nn.Module) -> dict[str, torch.device]:
    return {n: p.device for n, p in model.named_parameters()}


async def _refit(ident, registry, trainer, server, versions=(1,), **kw) -> list[rf.RefitResult]:
    results = []
    with anyio.fail_after(30):
        async with (
            rf.Publisher(registry, identity=ident) as pub,
            rf.Receiver(server, registry, identity=ident, **kw) as recv,
        ):
            for v in versions:
                with torch.no_grad():
                    for p in trainer.parameters():
                        p.add_(0.5)  # a training step, in place on the trainer's device
                await pub.publish(v, dict(trainer.named_parameters()))
                results.append(await recv.refit(v))
                assert recv.fence.state == "ready" and recv.status.committed_version == v
    return results


@pytest.mark.asyncio
@pytest.mark.parametrize(("mode", "commit"), MODES)
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "staged-cast"])
async def test_refit_between_device_tensors_in_every_mode(ident, registry, device, mode, commit, direct) -> None:
    # bf16 -> bf16 lands directly in the destination; bf16 -> fp32 is staged and cast on the device
    trainer = _on(mlp(1, dtype=torch.bfloat16), device)
    server = _on(mlp(2, dtype=torch.bfloat16 if direct else torch.float32), device)
    ptrs = {n: p.data_ptr() for n, p in server.named_parameters()}
    results = await _refit(ident, registry, trainer, server, versions=(1, 2, 3), mode=mode, shadow_commit=commit,
                           budget_bytes=8192)  # fmt: skip
    got = _values(server)
    assert all(torch.equal(got[n], v.to(got[n].dtype)) for n, v in _values(trainer).items())
    assert set(_devices(server).values()) == {device}
    if direct:
        assert all(r.direct_bytes == r.nbytes for r in results)
    else:
        assert all(r.direct_bytes == 0 and 0 < r.peak_staging_bytes <= 8192 for r in results)
    kept = {n: p.data_ptr() for n, p in server.named_parameters()} == ptrs
    assert kept is (commit == "copy" or mode == "in_place")  # a shadow swap moves every parameter


@pytest.mark.asyncio
@pytest.mark.parametrize("placement", ["host->device", "device->host", "split-model"])
async def test_mixed_placements_land_each_parameter_on_its_own_device(ident, registry, device, placement) -> None:
    trainer, server = mlp(1, dtype=torch.bfloat16), mlp(2, dtype=torch.bfloat16)
    if placement == "host->device":
        server.to(device)
    elif placement == "device->host":
        trainer.to(device)
    else:  # the receiver's first layer on the device, the rest on the host; the trainer the other way round
        server[0].to(device)
        trainer[2].to(device)
    before = _devices(server)
    await _refit(ident, registry, trainer, server, versions=(1, 2), mode="shadow", budget_bytes=4096)
    assert _devices(server) == before
    assert all(torch.equal(_values(server)[n], v) for n, v in _values(trainer).items())


@pytest.mark.asyncio
async def test_staging_lives_on_the_destination_device_within_the_budget(ident, registry, device) -> None:
    trainer, server = _on(mlp(1, dtype=torch.bfloat16), device), _on(mlp(2), device)
    with anyio.fail_after(30):
        async with (
            rf.Publisher(registry, identity=ident) as pub,
            rf.Receiver(server, registry, identity=ident, budget_bytes=4096) as recv,
        ):
            await pub.publish(1, dict(trainer.named_parameters()))
            result = await recv.refit(1)
            ring = recv._arena.ring(str(server[0].weight.device)) if recv._arena is not None else None
            assert ring is not None and ring.buffer.device == server[0].weight.device
            assert recv._arena is not None and recv._arena.allocated_bytes <= 4096
            assert 0 < result.peak_staging_bytes <= 4096 and recv.budget.statistics().used_bytes == 0


@pytest.mark.asyncio
async def test_fp8_destination_is_quantised_on_its_device(ident, registry, device) -> None:
    torch.manual_seed(0)
    weight = torch.randn(256, 200, dtype=torch.bfloat16, device=device)
    server = {
        "w": torch.zeros(256, 200, dtype=torch.float8_e4m3fn, device=device),
        "w_scale_inv": torch.zeros(2, 2, device=device),
    }
    with anyio.fail_after(30):
        async with (
            rf.Publisher(registry, identity=ident) as pub,
            rf.Receiver(server, registry, identity=ident, budget_bytes=1 << 16) as recv,
        ):
            await pub.publish(1, {"w": weight})
            await recv.refit(1)
    assert server["w"].device == server["w_scale_inv"].device == weight.device
    got, want = dequantize(server["w"], server["w_scale_inv"]).cpu(), weight.float().cpu()
    scale = server["w_scale_inv"].cpu().repeat_interleave(128, 0).repeat_interleave(128, 1)[:256, :200]
    assert (server["w_scale_inv"] > 0).all()
    assert ((got - want).abs() <= torch.maximum(want.abs() * 2**-4, scale * 2**-10) * (1 + 1e-6)).all()
