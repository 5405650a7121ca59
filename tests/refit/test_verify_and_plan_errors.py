"""Integrity and planning errors: detected, typed, and nothing half-done."""

from __future__ import annotations

import dataclasses

import anyio
import pytest
import torch

import refitflow as rf
from refitflow.refit.coverage import CoverageTracker
from tests.conftest import mlp, params, same


@pytest.mark.asyncio
@pytest.mark.parametrize("skip_unchanged", [True, False], ids=["delta", "digests-beside-reads"])
@pytest.mark.parametrize("mode", ["in_place", "shadow"])
async def test_digest_mismatch_is_detected(ident, registry, mode: str, skip_unchanged: bool) -> None:
    """Caught with the digests taken before the reads (a delta decision needs them) and beside them (none does:
    ``Placing``, verify holds the buckets hashed until they are in)."""
    trainer, server = mlp(1), mlp(2)
    old = params(server)
    with anyio.fail_after(20):
        async with (
            rf.Publisher(registry, identity=ident) as pub,
            rf.Receiver(server, registry, identity=ident, mode=mode, skip_unchanged=skip_unchanged) as recv,
        ):
            await pub.publish(1, dict(trainer.named_parameters()))
            with torch.no_grad():
                trainer[2].bias[3] += 1.0  # the trainer changed a byte before the receiver read it
            with pytest.raises(rf.IntegrityError) as info:
                await recv.refit(1)
            assert info.value.tensor == "2.bias" and info.value.version == 1
            if mode == "shadow":
                assert recv.fence.state == "ready" and same(server, old)
            else:
                assert recv.fence.state == "fenced"


async def _refit_error(ident, registry, trainer: dict, server, **kw) -> tuple[BaseException, rf.Receiver]:
    with anyio.fail_after(20):
        async with (
            rf.Publisher(registry, identity=ident) as pub,
            rf.Receiver(server, registry, identity=ident, **kw) as recv,
        ):
            await pub.publish(1, trainer)
            with pytest.raises(rf.RefitError) as info:
                await recv.refit(1)
    return info.value, recv


@pytest.mark.asyncio
async def test_unknown_name_is_a_plan_error_before_any_write(ident, registry) -> None:
    trainer = params(mlp(1)) | {"extra.weight": torch.ones(3)}
    server = mlp(2)
    old = params(server)
    err, recv = await _refit_error(ident, registry, trainer, server)
    assert isinstance(err, rf.PlanError) and "extra.weight" in str(err)
    assert recv.fence.state == "ready" and same(server, old)


@pytest.mark.asyncio
async def test_shape_mismatch_is_a_plan_error(ident, registry) -> None:
    trainer = params(mlp(1)) | {"0.weight": torch.ones(64, 32)}
    err, recv = await _refit_error(ident, registry, trainer, mlp(2))
    assert isinstance(err, rf.PlanError) and "shape mismatch" in str(err) and err.tensor == "0.weight"
    assert recv.fence.state == "ready"


@pytest.mark.asyncio
async def test_lossy_cast_is_refused_unless_asked_for(ident, registry) -> None:
    trainer = params(mlp(1))  # fp32
    server = mlp(2, dtype=torch.bfloat16)
    err, _ = await _refit_error(ident, registry, trainer, server)
    assert isinstance(err, rf.PlanError) and "loses information" in str(err)
    registry2 = rf.Registry()
    async with (
        rf.Publisher(registry2, identity=ident) as pub,
        rf.Receiver(server, registry2, identity=ident, lossy_casts=True) as recv,
    ):
        await pub.publish(1, trainer)
        await recv.refit(1)
    assert same(server, {n: t.to(torch.bfloat16) for n, t in trainer.items()})


@pytest.mark.asyncio
async def test_missing_parameter_is_a_coverage_error_before_any_write(ident, registry) -> None:
    trainer = params(mlp(1))
    del trainer["2.bias"]
    server = mlp(2)
    old = params(server)
    err, recv = await _refit_error(ident, registry, trainer, server)
    assert isinstance(err, rf.CoverageError) and err.missing == ["2.bias"] and not err.duplicated
    assert recv.fence.state == "ready" and same(server, old)


def test_unknown_dtype_in_a_manifest_is_refused() -> None:
    with pytest.raises(rf.ManifestError, match="unknown dtype"):
        rf.ShardSpec(name="w", dtype="float7", global_shape=(2,), axis=None, start=0, stop=2, digest="0" * 16, region=0)


def test_coverage_check_lists_missing_and_duplicated_first_20() -> None:
    expected = {f"p{i}": 4 for i in range(30)}
    cov = CoverageTracker(expected)
    for i in range(25):
        cov.record(f"p{i}", "all", 4)
    cov.record("p0", "all", 4)  # the same region twice
    cov.record("p1", "other-half", 4)  # more elements than the parameter has
    with pytest.raises(rf.CoverageError) as info:
        cov.check(version=9)
    err = info.value
    assert err.missing == [f"p{i}" for i in range(25, 30)]
    assert err.duplicated == ["p0", "p1"] and err.version == 9
    many = CoverageTracker({f"q{i:02d}": 1 for i in range(40)})
    with pytest.raises(rf.CoverageError) as info2:
        many.check()
    assert "missing 40:" in str(info2.value) and "q19" in str(info2.value) and "q20" not in str(info2.value)


@pytest.mark.asyncio
@pytest.mark.parametrize("skip_unchanged", [True, False], ids=["delta", "digests-beside-reads"])
@pytest.mark.parametrize("mode", ["in_place", "shadow"])
async def test_shards_moved_under_a_cached_layout_digest_fail_the_refit_typed_and_the_next_version_commits(
    ident, registry, mode: str, skip_unchanged: bool
) -> None:
    """A whole publication's digests are taken before the check that its shards are where the cached plan put
    them (that check runs beside the first reads; with no delta decision the digests are taken there too): a
    publisher that keeps its layout digest while moving its shards fails the refit with that check's
    ``ManifestError`` — never an ``IntegrityError`` from comparing other shards' digests, never a commit — and
    the next good version commits."""
    trainer, server = mlp(1), mlp(2)
    with anyio.fail_after(20):
        async with (
            rf.Publisher(registry, identity=ident) as pub,
            rf.Receiver(server, registry, identity=ident, mode=mode, skip_unchanged=skip_unchanged) as recv,
        ):
            good = await pub.publish(1, dict(trainer.named_parameters()))
            await recv.refit(1)
            shards = tuple(reversed(good.shards))  # moved; the layout digest (the plan cache's key) kept
            moved = dataclasses.replace(good, version=2, shards=shards, revision="", layout_digest=good.layout_digest)
            await registry.publish(moved)
            with pytest.raises(rf.ManifestError, match="not where, or not what"):
                await recv.refit(2)
            assert recv.status.committed_version == 1
            assert recv.fence.state == ("ready" if mode == "shadow" else "fenced")
            with torch.no_grad():
                trainer[0].weight.mul_(2)
            await pub.publish(3, dict(trainer.named_parameters()))
            result = await recv.refit(3)
            assert result.version == 3 and recv.fence.state == "ready" and same(server, params(trainer))
