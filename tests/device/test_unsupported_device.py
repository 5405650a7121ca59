"""A device refitflow cannot move bytes to or from (here ``meta``: real tensors, no memory) is a
``ConfigError`` at ``publish()`` / ``Receiver(...)``, before anything is registered or written."""

from __future__ import annotations

import anyio
import pytest
import torch

import refitflow as rf
from tests.conftest import mlp


@pytest.mark.asyncio
@pytest.mark.parametrize("transport", ["loopback", "nixl"])
async def test_publishing_a_meta_tensor_is_refused_before_any_registration(ident, registry, transport) -> None:
    tensors = {"a": torch.ones(4, 4), "b": torch.empty(4, 4, device="meta")}
    with anyio.fail_after(30):
        async with rf.Publisher(registry, identity=ident, transport=transport) as pub:
            with pytest.raises(rf.ConfigError, match="'b' is on device meta; refitflow moves weights between CPU"):
                await pub.publish(1, tensors)
            regions = pub.transport._regions if transport == "loopback" else pub.transport._local  # type: ignore[attr-defined]
            assert regions == {} and pub.published == []
            assert await registry.latest(ident) is None
            await pub.publish(2, {"a": tensors["a"]})  # the next good version publishes
            assert pub.published == [2]


def test_a_receiver_for_a_meta_model_is_refused_at_construction(ident, registry) -> None:
    server = mlp(2).to("meta")
    with pytest.raises(rf.ConfigError, match=r"destination parameter '0\.weight' is on device meta"):
        rf.Receiver(server, registry, identity=ident, transport="nixl")


def test_shadow_commit_copy_needs_shadow_mode(ident, registry) -> None:
    with pytest.raises(rf.ConfigError, match="shadow_commit='copy' applies to mode='shadow' only"):
        rf.Receiver(mlp(2), registry, identity=ident, shadow_commit="copy")
    with pytest.raises(rf.ConfigError, match="shadow_commit must be 'swap' or 'copy'"):
        rf.Receiver(mlp(2), registry, identity=ident, mode="shadow", shadow_commit="swapped")
