"""CUDA-only checks: refit streams and events, VRAM registration over NIXL, CUDA graphs.

Marked ``cuda``: where no GPU is visible they are deselected and listed with the reason
(tests/conftest.py). ``python bench/gpu_check.py`` runs them on a lent GPU machine.
"""

from __future__ import annotations

import anyio
import pytest
import torch

import refitflow as rf
from refitflow.refit.device import DeviceLane
from tests.conftest import mlp, params, same

pytestmark = pytest.mark.cuda
LONG_SLEEP = 200_000_000  # cycles: ≈ 100 ms of device time


def _cuda() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


@pytest.mark.asyncio
async def test_refit_streams_are_dedicated_and_waited_for_off_the_event_loop() -> None:
    dev = _cuda()
    lane = DeviceLane([dev])
    stream = lane.stream(dev)
    assert stream == lane.stream(dev) and stream != torch.cuda.current_stream(dev)
    with lane.use([dev]):
        assert torch.cuda.current_stream(dev) == stream
        torch.cuda._sleep(LONG_SLEEP)
        marks = lane.record([dev])
    assert torch.cuda.current_stream(dev) != stream and len(marks) == 1
    assert not marks[0].query()  # still running on the refit stream
    ticks = 0
    done = anyio.Event()

    async def ticker() -> None:
        nonlocal ticks
        while not done.is_set():
            ticks += 1
            await anyio.sleep(0.001)

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker)
            await lane.wait(marks)
            done.set()
    assert marks[0].query() and ticks > 0  # the loop kept running while the device worked
    with lane.use([dev]):
        torch.cuda._sleep(LONG_SLEEP)
    await lane.drain()
    assert stream.query()


@pytest.mark.asyncio
@pytest.mark.parametrize("placement", ["cuda->cuda", "cpu->cuda", "cuda->cpu"])
@pytest.mark.parametrize("mode", ["in_place", "shadow"])
async def test_nixl_lands_in_vram_registered_on_its_device(ident, registry, placement: str, mode: str) -> None:
    dev = _cuda()
    src, dst = placement.split("->")
    trainer = mlp(1, dtype=torch.bfloat16).to(dev if src == "cuda" else "cpu")
    # bf16 -> bf16 lands directly, the fp32 head is staged and cast: both paths, registered memory only
    server = mlp(2, dtype=torch.bfloat16).to(dev if dst == "cuda" else "cpu")
    server[2].float()
    with anyio.fail_after(60):
        async with (
            rf.Publisher(registry, identity=ident, transport="nixl") as pub,
            rf.Receiver(server, registry, identity=ident, transport="nixl", mode=mode, budget_bytes=1 << 16) as recv,
        ):
            for v in (1, 2):
                with torch.no_grad():
                    for p in trainer.parameters():
                        p.add_(1.0)
                await pub.publish(v, dict(trainer.named_parameters()))
                result = await recv.refit(v)
                assert 0 < result.direct_bytes < result.nbytes
            regions = [loc.info for loc in recv._transport._local.values()]  # type: ignore[union-attr]
    got = {n: t.cpu() for n, t in params(server).items()}
    assert all(torch.equal(got[n], t.cpu().to(got[n].dtype)) for n, t in params(trainer).items())
    if dst == "cuda":
        assert regions and {(r.mem, r.devid) for r in regions} == {("VRAM", dev.index)}  # params, shadows, staging
    else:
        assert {r.mem for r in regions} == {"DRAM"}


def _captured(model: torch.nn.Module, x: torch.Tensor) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(3):
            model(x)  # warm-up outside the capture, as CUDA graphs require
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        out = model(x)
    return graph, out


@pytest.mark.asyncio
@pytest.mark.parametrize(("mode", "commit", "sees_new"), [("in_place", "swap", True), ("shadow", "copy", True),
                                                          ("shadow", "swap", False)])  # fmt: skip
async def test_a_captured_cuda_graph_sees_the_new_weights_unless_shadow_swaps(
    ident, registry, mode: str, commit: str, sees_new: bool
) -> None:
    dev = _cuda()
    trainer, server = mlp(1).to(dev), mlp(2).to(dev)
    x = torch.randn(16, 64, device=dev)
    old_out = server(x).detach().clone()
    with anyio.fail_after(60):
        async with (
            rf.Publisher(registry, identity=ident) as pub,
            rf.Receiver(server, registry, identity=ident, mode=mode, shadow_commit=commit) as recv,
        ):
            graph, out = _captured(server, x)
            await pub.publish(1, dict(trainer.named_parameters()))
            await recv.refit(1)
            graph.replay()
            torch.cuda.synchronize()
    assert same(server, params(trainer))
    new_out = trainer(x).detach()
    want = new_out if sees_new else old_out  # a swap: the graph still reads the retired storage (hence "copy")
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(new_out, old_out, rtol=1e-2, atol=1e-2)  # the two versions are told apart


@pytest.mark.asyncio
async def test_publish_waits_for_the_step_queued_on_the_trainers_stream(ident, registry) -> None:
    dev = _cuda()
    w = torch.zeros(1024, 256, device=dev)
    server = {"w": torch.zeros(1024, 256, device=dev)}
    trainer_stream = torch.cuda.Stream(device=dev)  # non-blocking: the default stream does not wait for it
    with anyio.fail_after(60):
        async with (
            rf.Publisher(registry, identity=ident) as pub,
            rf.Receiver(server, registry, identity=ident) as recv,
        ):
            with torch.cuda.stream(trainer_stream):
                torch.cuda._sleep(LONG_SLEEP)
                w.fill_(3.0)  # the optimizer step, still queued when publish is called
                await pub.publish(1, {"w": w})
            await recv.refit(1)  # digests of the finished step: verified
    assert bool((server["w"] == 3.0).all())
