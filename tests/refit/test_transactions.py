"""Transactions: version order, one open at a time, failures and cancellation leave nothing half-done."""

from __future__ import annotations

import anyio
import pytest
import torch

import refitflow as rf
from tests.conftest import FailAt, InjectedFailure, mlp, params, same

STAGES = ["discover", "plan", "allocate", "pull", "translate", "apply", "verify", "commit"]
# staged refit: the destination is first written by apply; pull and translate touch only staging
WRITES_BEFORE = {"apply", "verify", "commit"}


async def _publish(pub: rf.Publisher, version: int, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    await pub.publish(version, dict(model.named_parameters()))
    return params(model)


@pytest.mark.asyncio
async def test_replay_and_out_of_order_versions_are_refused(ident, registry) -> None:
    trainer, server = mlp(1), mlp(2)
    observer = FailAt("none")
    with anyio.fail_after(20):
        async with (
            rf.Publisher(registry, identity=ident) as pub,
            rf.Receiver(server, registry, identity=ident, observer=observer) as recv,
        ):
            await _publish(pub, 3, trainer)
            assert (await recv.refit(3)).version == 3
            with pytest.raises(rf.AlreadyCommittedError, match="already serves version 3"):
                await recv.refit(1)  # newest complete ≥ 1 is 3 again: a replay (a VersionError)
            assert recv.status.committed_version == 3 and recv.fence.state == "ready"
            with pytest.raises(rf.RefitTimeoutError):
                await recv.refit(timeout=0.2)  # default min_version = last begun + 1: nothing yet
            v5 = await _publish(pub, 5, mlp(5))
            assert (await recv.refit()).version == 5
            assert same(server, v5)
    assert ("refused", None) in observer.outcomes and ("committed", 5) in observer.outcomes


@pytest.mark.asyncio
async def test_one_open_transaction_at_a_time(ident, registry) -> None:
    trainer, server = mlp(1), mlp(2)
    with anyio.fail_after(20):
        async with (
            rf.Publisher(registry, identity=ident) as pub,
            rf.Receiver(server, registry, identity=ident, mode="shadow") as recv,
        ):
            expected = await _publish(pub, 1, trainer)
            txn, _ = await recv.prepare(1)  # verified, not visible
            assert not same(server, expected) and recv.status.in_progress
            await _publish(pub, 2, mlp(3))
            with pytest.raises(rf.VersionError, match="still open"):
                await recv.refit(2)
            await recv.finish(txn)
            assert same(server, expected) and recv.status.committed_version == 1


@pytest.mark.asyncio
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("mode", ["in_place", "shadow"])
async def test_failure_in_any_stage_aborts_cleanly(ident, registry, stage: str, mode: str) -> None:
    trainer, server = mlp(1, dtype=torch.bfloat16), mlp(2)  # bf16 -> fp32: staged, so every stage works
    old = params(server)
    observer = FailAt(stage)
    with anyio.fail_after(20):
        async with (
            rf.Publisher(registry, identity=ident) as pub,
            rf.Receiver(server, registry, identity=ident, mode=mode, observer=observer, budget_bytes=8192) as recv,
        ):
            await _publish(pub, 1, trainer)
            with pytest.raises(rf.RefitError, match=f"{stage} stage failed") as info:
                await recv.refit(1)
            assert isinstance(info.value.__cause__, InjectedFailure)
            assert recv.budget.statistics().used_bytes == 0
            assert not recv.status.in_progress and recv.status.committed_version is None
            assert "injected failure" in (recv.status.first_failure or "")
            if mode == "in_place" and stage in WRITES_BEFORE:
                assert recv.fence.state == "fenced" and not recv.status.healthy
                with pytest.raises(rf.FencedError):
                    recv.fence.check()
            else:
                assert recv.fence.state == "ready"
                assert same(server, old)  # the old version serves, bit-exact
            # the next good version commits
            good = mlp(7, dtype=torch.bfloat16)
            await _publish(pub, 2, good)
            observer.after = -1
            assert (await recv.refit(2)).version == 2
            assert recv.fence.state == "ready" and recv.status.first_failure is None
            assert same(server, {n: t.float() for n, t in params(good).items()})
    assert ("aborted", 1) in observer.outcomes and ("committed", 2) in observer.outcomes


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", ["in_place", "shadow"])
async def test_cancellation_mid_refit_aborts_cleanly(ident, registry, mode: str) -> None:
    trainer, server = mlp(1, dtype=torch.bfloat16), mlp(2)
    old = params(server)
    in_apply = anyio.Event()  # the first bucket was written; more remain
    observer = FailAt("apply", action=in_apply.set)
    with anyio.fail_after(20):
        async with (
            rf.Publisher(registry, identity=ident) as pub,
            rf.Receiver(server, registry, identity=ident, mode=mode, observer=observer, budget_bytes=4096) as recv,
        ):
            await _publish(pub, 1, trainer)
            async with anyio.create_task_group() as tg:
                tg.start_soon(recv.refit, 1)
                await in_apply.wait()
                tg.cancel_scope.cancel()
            assert recv.budget.statistics().used_bytes == 0 and not recv.status.in_progress
            assert recv.status.committed_version is None
            if mode == "in_place":
                assert recv.fence.state == "fenced"
            else:
                assert recv.fence.state == "ready" and same(server, old)


@pytest.mark.asyncio
async def test_fence_moves_ready_updating_ready_in_place(ident, registry) -> None:
    trainer, server = mlp(1), mlp(2)
    observer = FailAt("none")
    seen_during: list[str] = []
    with anyio.fail_after(20):
        async with (
            rf.Publisher(registry, identity=ident) as pub,
            rf.Receiver(server, registry, identity=ident, observer=observer) as recv,
        ):
            observer.action = lambda: seen_during.append(recv.fence.state)
            observer.stage, observer.after = "pull", 1
            await _publish(pub, 1, trainer)
            await recv.refit(1)
    assert seen_during == ["updating"] and observer.fences == ["updating", "ready"]


@pytest.mark.asyncio
async def test_failure_after_a_direct_read_fences_in_place_and_consumes_the_version(ident, registry) -> None:
    trainer, server = mlp(1), mlp(2)  # same dtype: reads land straight in the live parameters
    with anyio.fail_after(20):
        async with (
            rf.Publisher(registry, identity=ident) as pub,
            rf.Receiver(server, registry, identity=ident, observer=FailAt("pull")) as recv,
        ):
            await _publish(pub, 1, trainer)
            with pytest.raises(rf.RefitError):
                await recv.refit(1)
            assert recv.fence.state == "fenced" and "partial write" in (recv.fence.reason or "")
            with pytest.raises(rf.VersionError):  # a failed attempt consumed its number
                await recv.refit(1)
