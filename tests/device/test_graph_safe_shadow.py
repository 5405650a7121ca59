"""``shadow_commit="copy"``: the shadow copy is written during the refit and copied into the live storage
at commit, fence ``updating`` for that one device copy; every parameter keeps its pointer (what a
captured CUDA graph needs), and the old version serves until then."""

from __future__ import annotations

import anyio
import pytest
import torch

import refitflow as rf
from tests.conftest import FailAt, mlp, params, same


@pytest.mark.asyncio
async def test_copy_commit_keeps_every_pointer_and_serves_the_old_version_until_commit(ident, registry, device):
    trainer, server = mlp(1).to(device), mlp(2).to(device)
    observer = FailAt("none")
    ptrs = {n: p.data_ptr() for n, p in server.named_parameters()}
    options = dict(mode="shadow", shadow_commit="copy", observer=observer)
    with anyio.fail_after(30):
        async with (
            rf.Publisher(registry, identity=ident) as pub,
            rf.Receiver(server, registry, identity=ident, **options) as recv,
        ):
            for v in (1, 2, 3):
                old = params(server)
                with torch.no_grad():
                    for p in trainer.parameters():
                        p.mul_(-1.5)
                await pub.publish(v, dict(trainer.named_parameters()))
                txn, _ = await recv.prepare(v)
                assert same(server, old) and recv.fence.state == "ready"  # prepared: the old version serves
                observer.fences.clear()
                await recv.finish(txn)
                assert observer.fences == ["updating", "ready"]  # closed only for the copy
                assert same(server, params(trainer)) and recv.status.committed_version == v
                assert {n: p.data_ptr() for n, p in server.named_parameters()} == ptrs


@pytest.mark.asyncio
@pytest.mark.parametrize("ending", ["abort-before-copy", "copy-fails-midway"])
async def test_a_prepared_version_that_does_not_commit(ident, registry, device, ending: str) -> None:
    """Aborted before the copy: the old version serves. A copy failing midway: fenced. Either way the
    next good version commits (and clears the fence)."""
    trainer, server = mlp(1).to(device), mlp(2).to(device)
    old = params(server)
    with anyio.fail_after(30):
        async with (
            rf.Publisher(registry, identity=ident) as pub,
            rf.Receiver(server, registry, identity=ident, mode="shadow", shadow_commit="copy") as recv,
        ):
            await pub.publish(1, dict(trainer.named_parameters()))
            txn, _ = await recv.prepare(1)
            if ending == "abort-before-copy":
                await recv.abort(txn, "a peer of the engine was not ready")
                assert same(server, old) and recv.fence.state == "ready"
            else:
                real_copy = recv.destination.copy_in

                def copy_half_then_fail() -> None:  # an injected device failure halfway through the copy
                    first = next(iter(recv.destination.params))
                    recv.destination.params[first].detach().copy_(recv.destination.shadows[first])
                    raise RuntimeError("injected: device copy failed")

                recv.destination.copy_in = copy_half_then_fail  # type: ignore[method-assign]
                with pytest.raises(RuntimeError, match="injected"):
                    await recv.finish(txn)
                assert recv.fence.state == "fenced"
                assert "copy into the live parameters failed" in (recv.fence.reason or "")
                recv.destination.copy_in = real_copy  # type: ignore[method-assign]
            assert recv.status.committed_version is None and not recv.status.in_progress
            await pub.publish(2, dict(trainer.named_parameters()))
            await recv.refit(2)
            assert recv.fence.state == "ready" and same(server, params(trainer))
