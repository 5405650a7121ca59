"""A parameter whose storage the server replaced behind refitflow's back (``param.data = …``,
``module.to(…)``) is refused before anything is written: the receiver's views, registrations and
plans point at the old storage, which the model no longer reads, so a refit would "commit" a version
the model never sees. ``rebind()`` follows the model as it is now (Parameter objects replaced too)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import anyio
import pytest
import torch

import refitflow as rf


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))


def _weights(version: int) -> dict[str, torch.Tensor]:
    return {n: torch.full_like(p.detach(), float(version)) for n, p in _model().named_parameters()}


def _holds(model: torch.nn.Module, version: int) -> bool:
    return all(torch.equal(p.detach(), _weights(version)[n]) for n, p in model.named_parameters())


@pytest.mark.asyncio
@pytest.mark.parametrize(("mode", "serve"), [("in_place", False), ("shadow", True)])
async def test_a_replaced_storage_is_refused_before_anything_is_written_and_rebind_follows_it(
    ident, registry, mode, serve
) -> None:
    model = _model()
    with anyio.fail_after(30):
        async with (
            rf.Publisher(registry, identity=ident) as pub,
            rf.Receiver(model, registry, identity=ident, mode=mode, serve_replicas=serve) as recv,
        ):
            for v in (1, 2):  # shadow mode swaps storages itself at each commit: that is no move
                await pub.publish(v, _weights(v))
                assert (await recv.refit(v)).version == v and _holds(model, v)
            regions = len(recv._transport._regions)  # type: ignore[union-attr]
            fresh = torch.full_like(model[1].bias.detach(), -7.0)
            model[1].bias.data = fresh  # the server reallocates one parameter
            await pub.publish(3, _weights(3))
            with pytest.raises(
                rf.PlanError, match=r"no longer sit where this receiver writes.*'1\.bias'.*rebind"
            ) as err:
                await recv.refit(3)
            assert err.value.tensor == "1.bias"
            assert torch.equal(model[1].bias.detach(), fresh)  # nothing written, anywhere the model reads
            assert torch.equal(model[0].weight.detach(), _weights(2)["0.weight"])
            assert recv.status.committed_version == 2 and recv.status.healthy
            await recv.rebind()
            result = await recv.refit(3)
            assert result.version == 3 and _holds(model, 3)
            assert result.skipped_bytes == 0  # what the new storage holds is unknown: every byte read
            assert len(recv._transport._regions) == regions  # type: ignore[union-attr]  # the old ones let go
            await pub.publish(4, _weights(4))
            assert (await recv.refit(4)).version == 4 and _holds(model, 4)


@contextlib.asynccontextmanager
async def _serving_v1(ident, registry, model: torch.nn.Module) -> AsyncIterator[tuple[rf.Publisher, rf.Receiver]]:
    """A publisher and an in-place receiver of ``model``, version 1 committed."""
    with anyio.fail_after(30):
        async with (
            rf.Publisher(registry, identity=ident) as pub,
            rf.Receiver(model, registry, identity=ident) as recv,
        ):
            await pub.publish(1, _weights(1))
            await recv.refit(1)
            yield pub, recv


@pytest.mark.asyncio
async def test_rebind_follows_a_parameter_object_replaced_on_its_module(ident, registry) -> None:
    """Not detected (the receiver holds the old Parameter object, whose storage did not move), but a
    server that replaced Parameter objects (a reload) calls rebind() and the next version lands in them."""
    model = _model()
    async with _serving_v1(ident, registry, model) as (pub, recv):
        model[0].weight = torch.nn.Parameter(torch.zeros(16, 8))
        await recv.rebind()
        await pub.publish(2, _weights(2))
        assert (await recv.refit(2)).version == 2 and _holds(model, 2)


@pytest.mark.asyncio
async def test_a_module_moved_to_another_dtype_is_refused(ident, registry) -> None:
    model = _model()
    async with _serving_v1(ident, registry, model) as (pub, recv):
        model.to(torch.float64)  # module.to() sets param.data = converted copy, every parameter
        await pub.publish(2, _weights(2))
        with pytest.raises(rf.PlanError, match=r"4 parameter\(s\) no longer sit"):
            await recv.refit(2)
        assert all(p.dtype == torch.float64 and float(p.detach().view(-1)[0]) == 1.0 for p in model.parameters())
