"""Two-phase publication: a version announced before its digests is read at once and committed only
once its digests arrived and every byte matched them (embedded registry, loopback transport)."""

from __future__ import annotations

import base64
import dataclasses

import anyio
import pytest
import torch
import xxhash

import refitflow as rf
from refitflow.metrics import NullObserver
from tests.api.test_delta import NBYTES, N, exact, layers, zeros


class GatedRegistry(rf.Registry):
    """Holds back every complete manifest (the digests) until ``release``; ``corrupt`` flips a digest."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = anyio.Event()
        self.corrupt = False
        self.held: list[rf.Manifest] = []

    def release(self) -> None:
        self.gate.set()

    async def publish(self, manifest: rf.Manifest, *, owner: str | None = None) -> None:
        if not manifest.pending:
            self.held.append(manifest)
            await self.gate.wait()
            if self.corrupt:
                s = manifest.shards[0]
                flipped = bytes([s.digest_bytes[0] ^ 1]) + s.digest_bytes[1:]
                bad = dataclasses.replace(s, blocks=base64.b64encode(flipped).decode(),
                                          digest=xxhash.xxh3_64_hexdigest(flipped))  # fmt: skip
                manifest = dataclasses.replace(manifest, revision="", shards=(bad, *manifest.shards[1:]))
        await super().publish(manifest, owner=owner)


class Seen(NullObserver):
    def __init__(self) -> None:
        self.pulled = 0
        self.first_pull = anyio.Event()

    def stage_item(self, stage: str, nbytes: int, seconds: float) -> None:
        if stage == "pull":
            self.pulled += nbytes
            self.first_pull.set()


async def read_early(registry: GatedRegistry, pub: rf.Publisher, recv: rf.Receiver, seen: Seen, version: int,
                     tensors: dict[str, torch.Tensor]) -> rf.RefitResult | rf.RefitError:  # fmt: skip
    """Publish ``version`` early with its digests held back until the receiver read its first bytes; the
    refit's result, or its error."""
    registry.gate, seen.first_pull = anyio.Event(), anyio.Event()
    out: list[rf.RefitResult | rf.RefitError] = []

    async def refit() -> None:
        try:
            out.append(await recv.refit(version))
        except rf.RefitError as exc:
            out.append(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(pub.publish, version, tensors)
        tg.start_soon(refit)
        await seen.first_pull.wait()
        assert recv.ledger.committed_version != version and not out  # reading, not committed
        registry.release()
    return out[0]


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", ["in_place", "shadow"])
async def test_a_version_announced_early_is_read_before_its_digests_and_committed_after(ident, mode: str) -> None:
    registry, seen, dst = GatedRegistry(), Seen(), zeros()
    v1 = layers(1)
    with anyio.fail_after(30):
        async with (
            rf.Publisher(registry, identity=ident, announce_early=True) as pub,
            rf.Receiver(dst, registry, identity=ident, mode=mode, observer=seen, budget_bytes=64 << 10) as recv,
        ):
            result = await read_early(registry, pub, recv, seen, 1, v1)
            assert isinstance(result, rf.RefitResult) and result.version == 1 and exact(dst, v1)
            complete = await registry.latest(ident)
            assert complete is not None and not complete.pending and result.revision == complete.revision
            assert recv.ledger.committed_revision == result.revision


@pytest.mark.asyncio
async def test_digests_that_never_follow_abort_the_refit_and_the_last_version_keeps_serving(ident) -> None:
    registry, dst = GatedRegistry(), zeros()
    v1, v2 = layers(1), layers(2)
    with anyio.fail_after(30):
        async with (
            rf.Publisher(registry, identity=ident, announce_early=True) as pub,
            rf.Receiver(dst, registry, identity=ident, mode="shadow", read_timeout_s=0.5) as recv,
        ):
            registry.release()
            await pub.publish(1, v1)
            assert (await recv.refit(1)).version == 1
            registry.gate = anyio.Event()  # version 2's digests are held back for good
            async with anyio.create_task_group() as tg:
                tg.start_soon(pub.publish, 2, v2)
                with pytest.raises(rf.RefitTimeoutError, match="digests of version 2 did not follow"):
                    await recv.refit(2)
                tg.cancel_scope.cancel()
            assert exact(dst, v1) and recv.ledger.committed_version == 1
            assert recv.status.healthy and recv.status.fence == "ready"
            registry.release()
            await pub.publish(3, layers(3))
            assert (await recv.refit(3)).version == 3 and exact(dst, layers(3))


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", ["in_place", "shadow"])
async def test_digests_that_do_not_match_the_bytes_read_early_fail_verification(ident, mode: str) -> None:
    registry, dst, seen = GatedRegistry(), zeros(), Seen()
    with anyio.fail_after(30):
        async with (
            rf.Publisher(registry, identity=ident, announce_early=True) as pub,
            rf.Receiver(dst, registry, identity=ident, mode=mode, observer=seen) as recv,
        ):
            registry.corrupt = True
            err = await read_early(registry, pub, recv, seen, 1, layers(1))
            assert isinstance(err, rf.IntegrityError) and "do not match the publisher's digests" in str(err)
            assert recv.ledger.committed_version is None
            # in place the rank stays fenced (it wrote); shadow never touched the live weights
            assert recv.status.fence == ("fenced" if mode == "in_place" else "ready")
            registry.corrupt = False
            result = await read_early(registry, pub, recv, seen, 2, layers(2))
            assert isinstance(result, rf.RefitResult) and result.version == 2
            assert exact(dst, layers(2)) and recv.status.healthy


@pytest.mark.asyncio
async def test_an_early_version_skips_nothing_and_the_next_one_skips_again(ident) -> None:
    """Delta refits need the digests before the reads: a version read early is read whole, and its digests,
    once in, let the next version (found with its digests) skip what did not change."""
    registry, dst, seen = GatedRegistry(), zeros(), Seen()
    registry.release()
    v1 = layers(1)
    with anyio.fail_after(30):
        async with (
            rf.Publisher(registry, identity=ident, announce_early=True) as pub,
            rf.Receiver(dst, registry, identity=ident, observer=seen) as recv,
        ):
            await pub.publish(1, v1)
            assert (await recv.refit(1)).skipped_bytes == 0
            v2 = layers(2, v1, k=N // 2)
            second = await read_early(registry, pub, recv, seen, 2, v2)
            assert isinstance(second, rf.RefitResult) and exact(dst, v2)
            assert second.skipped_bytes == 0 and second.nbytes == NBYTES
            v3 = layers(3, v2, k=N // 2)
            await pub.publish(3, v3)  # the receiver finds it complete: delta as usual
            third = await recv.refit(3)
            assert third.skipped_bytes == NBYTES // 2 and exact(dst, v3)


def test_the_publisher_announces_the_layout_first_then_the_same_layout_with_digests(ident) -> None:
    async def main() -> list[rf.Manifest]:
        registry = rf.Registry()
        seen: list[rf.Manifest] = []
        publish = registry.publish

        async def spy(m: rf.Manifest, *, owner: str | None = None) -> None:
            seen.append(m)
            await publish(m, owner=owner)

        registry.publish = spy  # type: ignore[method-assign]
        async with rf.Publisher(registry, identity=ident, announce_early=True) as pub:
            full = await pub.publish(1, {"w": torch.arange(4096, dtype=torch.float32).reshape(64, 64)})
        assert seen[-1] is full
        return seen

    first, second = anyio.run(main)
    assert first.pending and not second.pending and second.completes(first)
    assert first.layout_digest == second.layout_digest and first.revision == "" != second.revision


@pytest.mark.asyncio
@pytest.mark.parametrize("option", [{"read_early": False}, {"serve_replicas": True}])
async def test_a_receiver_that_waits_for_digests_never_sees_the_early_announcement(ident, option: dict) -> None:
    """``read_early=False``, and a relay (it serves verified bytes), see the version once it is complete."""
    registry, dst, seen = GatedRegistry(), zeros(), Seen()
    with anyio.fail_after(30):
        async with (
            rf.Publisher(registry, identity=ident, announce_early=True) as pub,
            rf.Receiver(dst, registry, identity=ident, observer=seen, **option) as recv,
        ):
            async with anyio.create_task_group() as tg:
                tg.start_soon(pub.publish, 1, layers(1))
                with pytest.raises(rf.RefitTimeoutError):
                    await recv.refit(1, timeout=0.3)
                assert seen.pulled == 0  # it saw nothing: the version is not complete yet
                registry.release()
            assert (await recv.refit(1)).version == 1 and exact(dst, layers(1))


@pytest.mark.asyncio
async def test_digests_of_another_layout_or_version_are_refused_before_anything_is_compared(ident) -> None:
    """Defence in depth beside the registry's own check: the receiver compares the complete version's layout
    with the one it read. (A stand-in registry answers here: the real one refuses such a manifest.)"""
    from refitflow.refit.stages.discover import _complete

    registry = rf.Registry()
    async with rf.Publisher(registry, identity=ident, announce_early=True) as pub:
        await pub.publish(1, layers(1))
        full = await registry.latest(ident)
    assert full is not None
    m = full.manifests[0]
    pending = rf.Publication(identity=ident, version=1, manifests=(dataclasses.replace(
        m, revision="", shards=tuple(dataclasses.replace(s, digest="", blocks="") for s in m.shards)),))  # fmt: skip
    moved = dataclasses.replace(m, revision="", shards=(dataclasses.replace(m.shards[0], offset=8), *m.shards[1:]))

    class Answers:
        def __init__(self, answer: rf.Publication) -> None:
            self.answer = answer

        async def wait_complete(self, identity, min_version, timeout, **kwargs) -> rf.Publication:
            return self.answer

    assert await _complete(Answers(full), pending, 1.0) is full
    with pytest.raises(rf.ManifestError, match="another layout"):
        await _complete(Answers(dataclasses.replace(full, manifests=(moved,))), pending, 1.0)
    with pytest.raises(rf.VersionError, match="version 2 completed before the digests of version 1"):
        await _complete(Answers(dataclasses.replace(full, version=2)), pending, 1.0)


@pytest.mark.asyncio
async def test_a_version_found_with_some_ranks_already_complete_commits(ident) -> None:
    """A receiver that finds a version laid out while one rank's digests are in and another's are not
    (the ranks of an engine complete one after the other) takes the complete ranks as they are. Before,
    it required every rank it had seen to be pending and refused the version ("another layout"): seen
    in CI's bench smoke run, where one rank's digests beat the other's by milliseconds."""

    class RankOneHeld(rf.Registry):
        gate = anyio.Event()

        async def publish(self, manifest: rf.Manifest, *, owner: str | None = None) -> None:
            if manifest.rank == 1 and not manifest.pending:
                await self.gate.wait()
            await super().publish(manifest, owner=owner)

    registry = RankOneHeld()
    a, b = torch.randn(64, 32), torch.randn(1000)
    dst = {"a": torch.zeros(64, 32), "b": torch.zeros(1000)}
    with anyio.fail_after(30):
        async with (
            rf.Publisher(registry, identity=ident, rank=0, world_size=2, announce_early=True) as p0,
            rf.Publisher(registry, identity=ident, rank=1, world_size=2, announce_early=True) as p1,
            rf.Receiver(dst, registry, identity=ident) as recv,
        ):
            async with anyio.create_task_group() as tg:
                tg.start_soon(p1.publish, 1, {"b": b})  # its layout now, its digests held back
                await p0.publish(1, {"a": a})  # layout and digests
                laid_out = await registry.wait_complete(ident, 1, 5, early=True)
                assert [m.pending for m in laid_out.manifests] == [False, True]
                result: list[rf.RefitResult] = []

                async def refit() -> None:
                    result.append(await recv.refit(1))

                tg.start_soon(refit)
                await anyio.sleep(0.2)  # the receiver reads what it found
                RankOneHeld.gate.set()
            assert result[0].version == 1 and torch.equal(dst["a"], a) and torch.equal(dst["b"], b)


def test_by_default_a_publisher_announces_early_once_versions_change_every_byte_and_not_after_a_frozen_one(
    ident,
) -> None:
    """``announce_early=None`` (the default): two-phase publication only where it costs receivers no delta
    skipping — after a version that changed every byte against the one before, not after one that kept half."""

    async def main() -> list[bool]:
        registry, pending = rf.Registry(), []
        publish = registry.publish

        async def spy(m: rf.Manifest, *, owner: str | None = None) -> None:
            pending.append(m.pending)
            await publish(m, owner=owner)

        registry.publish = spy  # type: ignore[method-assign]
        a, b = torch.zeros(64, 64), torch.zeros(64, 64)
        early = []
        async with rf.Publisher(registry, identity=ident) as pub:
            assert pub.announce_early is None
            for version, change in enumerate((a, a, a, b, a, a), 1):
                change.add_(1)  # v2: a changed; v4, v5: half frozen; v6: a
                if version in (2, 3):
                    b.add_(1)  # v2, v3: every byte changed
                pending.clear()
                await pub.publish(version, {"a": a, "b": b})
                assert pending == ([True, False] if pub.announced_early else [False])
                early.append(pub.announced_early)
        return early

    assert anyio.run(main) == [False, False, True, True, False, False]
