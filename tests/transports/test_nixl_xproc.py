"""NIXL across processes: a publisher process (``_nixl_peer``), this process receives.

Manifests travel as JSON lines (``core.wire``) and feed an embedded ``rf.Registry`` here.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import anyio
import pytest
import torch
from _nixl_peer import Peer, model

import refitflow as rf
from refitflow.transports.base import Read, Submitted
from refitflow.transports.nixl import NixlTransport

SPEC = {"tensors": 300, "numel": 1000, "model": "xproc"}
IDENT = rf.Identity(model="xproc")


def zeros_like_model() -> dict[str, torch.Tensor]:
    return {n: torch.zeros_like(t) for n, t in model(SPEC, 0).items()}


def same(dst: dict[str, torch.Tensor], seed: int) -> bool:
    expected = model(SPEC, seed)
    return set(dst) == set(expected) and all(torch.equal(dst[n], expected[n]) for n in expected)


async def served_at_least(peer: Peer, nbytes: int, timeout: float = 5.0) -> int:
    """The peer's served bytes once they reach ``nbytes`` (or whatever they are at the deadline)."""
    served = await peer.served()
    with anyio.move_on_after(timeout):
        for _ in iter(int, 1):  # polling another process: it has no event to wait on
            if served >= nbytes:
                break
            await anyio.sleep(0.01)
            served = await peer.served()
    return served


@pytest.mark.asyncio
async def test_many_small_tensors_from_another_process_are_bit_exact() -> None:
    registry = rf.Registry()
    dst = zeros_like_model()
    with anyio.fail_after(60):
        async with Peer(SPEC) as peer, rf.Receiver(dst, registry, identity=IDENT, transport="nixl") as recv:
            for version, seed in ((1, 11), (2, 12), (3, 13)):
                await registry.publish(await peer.publish(version, seed))
                result = await recv.refit(version)
                assert same(dst, seed)
                assert result.nbytes == sum(t.nbytes for t in dst.values())
                assert result.plan_cached == (version > 1)
                # every READ tells its owner how many bytes it took (NIXL notifications, which may
                # arrive just after the reader saw its READ done)
                assert await served_at_least(peer, version * result.nbytes) == version * result.nbytes


class KillBefore(NixlTransport):
    """Runs ``action`` once, just before the ``nth`` read (a real failure, no mock of NIXL)."""

    def __init__(self, nth: int) -> None:
        super().__init__()
        self.nth, self.calls = nth, 0
        self.action: object = None

    async def _count(self) -> None:
        self.calls += 1
        if self.calls == self.nth and self.action is not None:
            await self.action()  # type: ignore[operator]

    async def read(self, reads: Sequence[Read], *, key: Hashable | None = None, count: bool = True) -> None:
        await self._count()
        await super().read(reads, key=key, count=count)

    async def submit(self, reads: Sequence[Read], *, key: Hashable | None = None, count: bool = True) -> Submitted:
        await self._count()  # the pull stage posts its reads without waiting for them: a post is a read
        return await super().submit(reads, key=key, count=count)


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", ["in_place", "shadow"])
async def test_publisher_killed_mid_pull_fails_fast_then_a_live_publisher_commits(mode: str) -> None:
    registry = rf.Registry()
    dst = zeros_like_model()
    transport = KillBefore(nth=3)
    options = dict(direct_bucket_bytes=64 * 1024, read_timeout_s=10.0, refit_timeout_s=20.0)
    with anyio.fail_after(90):
        async with rf.Receiver(dst, registry, identity=IDENT, transport=transport, mode=mode, **options) as recv:
            async with Peer(SPEC) as first:
                await registry.publish(await first.publish(1, 21))
                await recv.refit(1)
                assert same(dst, 21)
                transport.action, transport.calls = first.kill, 0
                await registry.publish(await first.publish(2, 22))
                with anyio.fail_after(15):  # well inside the refit's own deadline
                    with pytest.raises((rf.TransportError, rf.RefitTimeoutError)) as caught:
                        await recv.refit(2)
            assert caught.value.version == 2
            if mode == "in_place":
                assert recv.status.fence == "fenced" and not recv.status.healthy
            else:
                assert recv.status.fence == "ready" and same(dst, 21)  # old version intact, still serving
            assert recv.status.committed_version == 1
            transport.action = None
            async with Peer(SPEC) as second:
                await registry.publish(await second.publish(3, 23))
                result = await recv.refit(3)
            assert result.version == 3 and same(dst, 23)
            assert recv.status.fence == "ready" and recv.status.committed_version == 3


def reads_into(transport: NixlTransport, manifest: rf.Manifest, dst: dict[str, torch.Tensor]) -> list[Read]:
    """One read per shard of ``manifest`` (whole tensors) straight into ``dst``."""
    transport.connect(manifest.source)
    return [Read(manifest.source.agent, s.region, s.offset, s.nbytes, dst[s.name].view(torch.uint8))
            for s in manifest.shards]  # fmt: skip


@pytest.mark.asyncio
async def test_one_read_from_two_peers_lands_the_live_ones_bytes_when_the_other_died() -> None:
    spec = {"tensors": 8, "numel": 50_000}
    a_dst, b_dst = (model(spec, 0) for _ in range(2))
    for t in (*a_dst.values(), *b_dst.values()):
        t.zero_()
    transport = NixlTransport()
    with anyio.fail_after(60):
        try:
            for t in (*a_dst.values(), *b_dst.values()):
                transport.register(t)
            async with Peer(spec) as a, Peer(spec) as b:
                ma, mb = await a.publish(1, 31), await b.publish(1, 32)
                reads = reads_into(transport, ma, a_dst) + reads_into(transport, mb, b_dst)  # a's reads first
                await transport.read(reads, key="both")  # both peers in one read(): posted together
                assert all(torch.equal(a_dst[n], t) for n, t in model(spec, 31).items())
                assert all(torch.equal(b_dst[n], t) for n, t in model(spec, 32).items())
                mb = await b.publish(2, 33)  # new bytes in b's same memory
                await a.kill()
                with pytest.raises(rf.TransportError, match="disconnected"):
                    await transport.read(reads, key="both")
                # a's failed post did not keep b's READ from being posted and waited for
                assert all(torch.equal(b_dst[n], t) for n, t in model(spec, 33).items())
                await b.publish(3, 34)
                await transport.read(reads_into(transport, mb, b_dst), key="b")  # the live peer reads on
                assert all(torch.equal(b_dst[n], t) for n, t in model(spec, 34).items())
        finally:
            await transport.aclose()
