"""A parameter whose storage the server replaced behind refitflow's back (``param.data = …``,
``module.to(…)``) is refused before anything is written: the receiver's views, registrations and
plans point at the old storage, which the model no longer reads, so a refit would "commit" a version
the model never sees."""

from __future__ import annotations

import anyio
import pytest
import torch

import refitflow as rf


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))


def _weights(version: int) -> dict[str, torch.Tensor]:
    return {n: torch.full_like(p.detach(), float(version)) for n, p in _model().named_parameters()}


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", ["in_place", "shadow"])
async def test_a_replaced_storage_is_refused_before_anything_is_written_and_a_new_receiver_refits_it(
    ident, registry, mode
) -> None:
    model = _model()
    with anyio.fail_after(30):
        async with rf.Publisher(registry, identity=ident) as pub:
            async with rf.Receiver(model, registry, identity=ident, mode=mode) as recv:
                for v in (1, 2):  # shadow mode swaps storages itself at each commit: that is no move
                    await pub.publish(v, _weights(v))
                    assert (await recv.refit(v)).version == v
                    assert torch.equal(model[0].weight.detach(), _weights(v)["0.weight"])
                fresh = torch.full_like(model[1].bias.detach(), -7.0)
                model[1].bias.data = fresh  # the server reallocates one parameter
                await pub.publish(3, _weights(3))
                with pytest.raises(rf.PlanError, match=r"no longer sit where this receiver writes.*'1\.bias'") as err:
                    await recv.refit(3)
                assert err.value.tensor == "1.bias"
                assert torch.equal(model[1].bias.detach(), fresh)  # nothing written, anywhere the model reads
                assert torch.equal(model[0].weight.detach(), _weights(2)["0.weight"])
                assert recv.status.committed_version == 2 and recv.status.healthy
            async with rf.Receiver(model, registry, identity=ident, mode=mode) as again:
                assert (await again.refit(3)).version == 3
                assert torch.equal(model[1].bias.detach(), _weights(3)["1.bias"])


@pytest.mark.asyncio
async def test_a_module_moved_to_another_dtype_is_refused(ident, registry) -> None:
    model = _model()
    with anyio.fail_after(30):
        async with (
            rf.Publisher(registry, identity=ident) as pub,
            rf.Receiver(model, registry, identity=ident) as recv,
        ):
            await pub.publish(1, _weights(1))
            await recv.refit(1)
            model.to(torch.float64)  # module.to() sets param.data = converted copy, every parameter
            await pub.publish(2, _weights(2))
            with pytest.raises(rf.PlanError, match=r"4 parameter\(s\) no longer sit"):
                await recv.refit(2)
            assert all(p.dtype == torch.float64 and float(p.detach().view(-1)[0]) == 1.0 for p in model.parameters())
