"""Receiver faults of the matrix: a concurrent refit, wider publications, compile filters, metrics, leaks."""

from __future__ import annotations

import gc
import os
import socket
from collections.abc import Hashable, Sequence

import anyio
import pytest
import torch

import refitflow as rf
from refitflow.layouts import Parallel, canonical_shapes, fused, megatron
from refitflow.layouts.canonical import ModelDims, from_canonical
from refitflow.layouts.wire import layout_metadata
from refitflow.metrics.prometheus import PrometheusMetrics
from refitflow.transports.base import Read
from tests.conftest import mlp, params, same


class GatedLoopback(rf.LoopbackTransport):
    """A real loopback transport whose reads wait for a gate: holds a refit mid-pull (staging leased)."""

    def __init__(self) -> None:
        super().__init__()
        self.reading = anyio.Event()
        self.gate = anyio.Event()

    async def read(self, reads: Sequence[Read], *, key: Hashable | None = None, count: bool = True) -> None:
        self.reading.set()
        await self.gate.wait()
        await super().read(reads, key=key, count=count)


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", ["in_place", "shadow"])
async def test_a_second_refit_is_refused_and_the_running_one_commits(ident, registry, mode: str) -> None:
    trainer, server = mlp(1, dtype=torch.bfloat16), mlp(2)  # staged (a cast): the arena is leased
    transport = GatedLoopback()
    with anyio.fail_after(30):
        async with (
            rf.Publisher(registry, identity=ident) as pub,
            rf.Receiver(server, registry, identity=ident, transport=transport, mode=mode, budget_bytes=8192) as recv,
        ):
            await pub.publish(1, dict(trainer.named_parameters()))
            async with anyio.create_task_group() as tg:
                tg.start_soon(recv.refit, 1)
                await transport.reading.wait()
                held = recv.budget.statistics().used_bytes
                assert held > 0
                for second in (recv.refit(1), recv.refit(), recv.prepare()):
                    with pytest.raises(rf.VersionError, match="already running"):
                        await second
                assert recv.budget.statistics().used_bytes == held  # the running refit's staging untouched
                transport.gate.set()
            assert recv.status.committed_version == 1 and recv.fence.state == "ready"
            assert same(server, {n: t.float() for n, t in params(trainer).items()})


def _dims(hidden: int) -> ModelDims:
    return ModelDims(vocab=64, hidden=hidden, layers=1, heads=4, kv_heads=2, head_dim=16, ffn=96)


@pytest.mark.asyncio
async def test_a_publication_wider_than_the_model_is_refused_before_any_write() -> None:
    wide, narrow = _dims(80), _dims(64)
    torch.manual_seed(0)
    canon = {n: torch.randn(s) for n, s in canonical_shapes(wide).items()}
    registry, ident = rf.Registry(), rf.Identity(model="tiny", layout="megatron")
    layout = fused.layout(narrow, Parallel())
    tensors = {n: torch.zeros(lt.shape) for n, lt in layout.items()}
    with anyio.fail_after(20):
        async with (
            rf.Publisher(registry, identity=ident, metadata=layout_metadata("megatron", wide, Parallel())) as pub,
            rf.Receiver(tensors, registry, identity=ident, layout=layout, budget_bytes=8192) as recv,
        ):
            await pub.publish(1, from_canonical(megatron.layout(wide, Parallel()), canon))
            with pytest.raises(rf.PlanError, match=r"shape mismatch: publication \(64, 80\), model \(64, 64\)"):
                await recv.refit(1)
    assert all(not t.any() for t in tensors.values())  # not a byte written
    assert recv.fence.state == "ready" and recv.status.committed_version is None


@pytest.mark.asyncio
async def test_discovery_finds_the_compile_target_the_receiver_asks_for(ident, registry) -> None:
    trt = rf.Identity(model=ident.model, compile_target="trt")
    trainer, server = mlp(1), mlp(2)
    with anyio.fail_after(20):
        async with (
            rf.Publisher(registry, identity=trt) as pub,
            rf.Receiver(server, registry, identity=ident, compile_targets=("trt",)) as recv,
        ):
            await pub.publish(1, dict(trainer.named_parameters()))
            assert (await recv.refit(1, timeout=5)).version == 1  # before: waited for 'hf_raw' forever
    assert same(server, params(trainer))


@pytest.mark.asyncio
async def test_a_compile_filter_refusal_consumes_no_version(ident, registry) -> None:
    trainer, server = mlp(1), mlp(2)
    old = params(server)
    with anyio.fail_after(20):
        async with (
            rf.Publisher(registry, identity=ident, compile_metadata={"quant": "none"}) as pub,
            rf.Receiver(server, registry, identity=ident, compile_metadata={"quant": "fp8"}) as recv,
        ):
            await pub.publish(1, dict(trainer.named_parameters()))
            with pytest.raises(rf.PlanError, match="compile metadata differs"):
                await recv.refit(1)
            assert recv.ledger.last_begun is None and recv.fence.state == "ready" and same(server, old)


def test_budget_capacity_reads_the_budget_before_anything_is_staged(ident, registry) -> None:
    metrics = PrometheusMetrics()
    rf.Receiver(mlp(2), registry, identity=ident, observer=metrics, budget_bytes=12345)
    assert metrics.registry.get_sample_value("refitflow_budget_capacity_bytes") == 12345


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _dead_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"  # nothing listens there once closed


@pytest.mark.asyncio
async def test_failed_receiver_enters_leak_no_file_descriptors(ident) -> None:
    address = _dead_address()

    async def fail_once() -> None:
        with anyio.move_on_after(0.3):  # the caller's deadline ends the enter mid-request
            async with rf.Receiver(mlp(2), address, identity=ident):
                raise AssertionError("a registry nobody serves cannot register this receiver")

    with anyio.fail_after(60):
        await fail_once()  # the first one loads what is loaded once (libzmq, threads)
        gc.collect()
        before = _fds()
        for _ in range(8):
            await fail_once()
        gc.collect()  # once blocked forever in a leaked ZMQ context
        assert _fds() <= before + 1, "failed enters leaked file descriptors"


@pytest.mark.asyncio
async def test_failed_publisher_enter_closes_its_registry_client(ident) -> None:
    pub = rf.Publisher(_dead_address(), identity=ident, transport="no-such-transport")
    with anyio.fail_after(10), pytest.raises(rf.ConfigError, match="unknown transport"):
        async with pub:
            raise AssertionError("unreachable")
    assert pub.registry._channel.closed  # type: ignore[attr-defined]
