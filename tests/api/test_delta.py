"""Delta refits: pieces whose digests did not change since the version a rank holds are not pulled."""

from __future__ import annotations

import anyio
import pytest
import torch

import refitflow as rf
from refitflow.transports import LoopbackTransport
from tests.conftest import FailAt, InjectedFailure

N = 8


def layers(seed: int, frozen: dict[str, torch.Tensor] | None = None, k: int = 0) -> dict[str, torch.Tensor]:
    """``N`` 2-D float32 tensors; the first ``k`` taken from ``frozen`` (fresh copies: new storages)."""
    g = torch.Generator().manual_seed(seed)
    out = {f"layers.{i}.weight": torch.randn(96, 64, generator=g) for i in range(N)}
    for name in list(out)[:k]:
        assert frozen is not None
        out[name] = frozen[name].clone()
    return out


def zeros() -> dict[str, torch.Tensor]:
    return {n: torch.zeros_like(t) for n, t in layers(0).items()}


def exact(dst: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(dst[n], t) for n, t in want.items())


NBYTES = N * 96 * 64 * 4


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", ["in_place", "shadow"])
@pytest.mark.parametrize("read_start", [0.0, 0.5])  # 0.5: the plan starts at the layers that change
async def test_a_half_frozen_model_pulls_half_the_bytes_and_stays_bit_exact(
    ident, registry, mode: str, read_start: float
) -> None:
    dst, trainer = zeros(), LoopbackTransport()
    with anyio.fail_after(30):
        async with (
            rf.Publisher(registry, identity=ident, transport=trainer) as pub,
            rf.Receiver(dst, registry, identity=ident, mode=mode, read_start=read_start) as recv,
        ):
            v1 = layers(1)
            await pub.publish(1, v1)
            first = await recv.refit(1)
            assert first.skipped_bytes == 0 and first.nbytes == NBYTES and exact(dst, v1)
            v2 = layers(2, v1, k=N // 2)  # half the layers frozen (new storages: the bytes, not the memory, repeat)
            await pub.publish(2, v2)
            before = trainer.served_bytes
            second = await recv.refit(2)
            assert exact(dst, v2)
            assert second.skipped_bytes == NBYTES // 2 and second.nbytes == NBYTES // 2
            assert trainer.served_bytes - before == NBYTES // 2
            v3 = layers(3, v2, k=N // 2)  # frozen again: in shadow mode the copy written now held version 1
            await pub.publish(3, v3)
            third = await recv.refit(3)
            assert exact(dst, v3) and third.skipped_bytes == NBYTES // 2
            if mode == "shadow":  # the other copy, live after the next swap, is complete too
                assert exact(recv.destination.shadows, v2)


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", ["in_place", "shadow"])
async def test_a_skipped_piece_changed_behind_refitflows_back_is_found_and_pulled_again(
    ident, registry, mode: str
) -> None:
    dst = zeros()
    with anyio.fail_after(30):
        async with (
            rf.Publisher(registry, identity=ident) as pub,
            rf.Receiver(dst, registry, identity=ident, mode=mode, recheck_fraction=1.0) as recv,
        ):
            v1 = layers(1)
            await pub.publish(1, v1)
            await recv.refit(1)
            recv.destination.live("layers.0.weight")[5, 7] += 1  # a frozen layer, written by someone else
            v2 = layers(2, v1, k=N // 2)
            await pub.publish(2, v2)
            result = await recv.refit(2)
            assert exact(dst, v2)
            assert result.rechecked_bytes == result.skipped_bytes == NBYTES // 2
            assert 0 < result.repaired_bytes < NBYTES // 2  # the changed part only, read again
            assert result.nbytes == NBYTES // 2 + result.repaired_bytes


@pytest.mark.asyncio
async def test_a_sampled_recheck_finds_a_changed_piece_within_its_rotation(ident, registry) -> None:
    dst = zeros()
    with anyio.fail_after(30):
        async with (
            rf.Publisher(registry, identity=ident) as pub,
            rf.Receiver(dst, registry, identity=ident, recheck_fraction=0.5) as recv,
        ):
            frozen = layers(1)
            await pub.publish(1, frozen)
            await recv.refit(1)
            dst["layers.1.weight"][90, 3] = 0.5  # a frozen layer, written by someone else
            repaired = 0
            for v in (2, 3):  # every skipped piece is re-hashed at least once every 1 / 0.5 refits
                await pub.publish(v, layers(v, frozen, k=N // 2))
                result = await recv.refit(v)
                assert 0 < result.rechecked_bytes < result.skipped_bytes
                repaired += result.repaired_bytes
            assert repaired > 0 and exact(dst, layers(3, frozen, k=N // 2))


@pytest.mark.asyncio
async def test_an_aborted_write_in_place_forgets_what_the_storage_held(ident, registry) -> None:
    dst = zeros()
    failing = FailAt("verify", after=2)
    with anyio.fail_after(30):
        async with (
            rf.Publisher(registry, identity=ident) as pub,
            rf.Receiver(dst, registry, identity=ident, observer=failing, direct_bucket_bytes=64 * 1024) as recv,
        ):
            v1 = layers(1)
            await pub.publish(1, v1)
            failing.after = 0
            await recv.refit(1)
            failing.seen, failing.after = 0, 2
            await pub.publish(2, layers(2))
            with pytest.raises(rf.RefitError) as info:
                await recv.refit(2)  # writes some of version 2, then fails: fenced
            assert isinstance(info.value.__cause__, InjectedFailure) and recv.fence.state.value == "fenced"
            v3 = layers(3, v1, k=N)  # version 1's bytes again: the rank no longer knows it holds any of them
            await pub.publish(3, v3)
            result = await recv.refit(3)
            assert result.skipped_bytes == 0 and exact(dst, v3) and recv.fence.state.value == "ready"


@pytest.mark.asyncio
async def test_skip_unchanged_off_pulls_every_byte(ident, registry) -> None:
    dst = zeros()
    async with (
        rf.Publisher(registry, identity=ident) as pub,
        rf.Receiver(dst, registry, identity=ident, skip_unchanged=False) as recv,
    ):
        v1 = layers(1)
        for v in (1, 2):
            await pub.publish(v, v1)
            result = await recv.refit(v)
            assert result.nbytes == NBYTES and result.skipped_bytes == 0


@pytest.mark.asyncio
async def test_another_digest_geometry_is_never_compared(ident, registry) -> None:
    dst = zeros()
    async with rf.Receiver(dst, registry, identity=ident) as recv:
        v1 = layers(1)
        async with rf.Publisher(registry, identity=ident, digest="xxh3") as pub:
            await pub.publish(1, v1)
            await recv.refit(1)
        async with rf.Publisher(registry, identity=ident, digest="mix64") as pub:  # same bytes, other digests
            await pub.publish(2, v1)
            result = await recv.refit(2)
        assert result.skipped_bytes == 0 and result.nbytes == NBYTES and exact(dst, v1)
