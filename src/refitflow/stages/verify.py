"""Verify: hash pulled bytes per digest block of the source shard, then release staging.

Publishers digest each block of rows of a shard (``ShardSpec.blocks``). Pieces arrive in plan
order (every stage is one task over FIFO streams) and a shard's pieces are planned in source
order, so a block's bytes may stream across pieces and buckets. A block is checked when its bytes
arrived whole and in order; a block only partly pulled (a column slice, an unaligned cut — possible
only under ``verify="pulled"``) counts as unverified bytes. Staged pieces are hashed in staging,
direct pieces where they landed.

Device work: the hashing runs on the bucket's refit streams (``Devices.use``, in the worker thread),
and the staging lease is freed only after the bucket's marks (apply's copies out of it) are waited
for. Until digests are computed on the device (issue 11, the digest scheme), device bytes are
copied to the host to be hashed (``_host``): correct, not yet fast.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import anyio.to_thread
import torch
import xxhash
from anyio.abc import ObjectReceiveStream, ObjectSendStream

from refitflow.core.errors import IntegrityError
from refitflow.core.types import ShardSpec
from refitflow.stages._context import StageContext, Work
from refitflow.transports.base import as_bytes

__all__ = ["run"]


@dataclass
class _State:
    specs: dict[tuple[int, str], ShardSpec] = field(default_factory=dict)
    digests: dict[tuple[int, str], list[str]] = field(default_factory=dict)
    open: dict[tuple[int, str, int], tuple[object, int]] = field(default_factory=dict)  # block -> (hasher, next)
    verified: int = 0


def _feed(st: _State, key: tuple[int, str], a: int, data: memoryview, bad: list[str]) -> None:
    """Feed source bytes [a, a + len(data)) of shard ``key`` to its block hashers."""
    spec = st.specs[key]
    digests = st.digests.get(key)
    if digests is None:  # decoded on first use, in the worker thread
        digests = st.digests[key] = spec.block_digests()
    size, total, end = spec.block_bytes, spec.nbytes, a + len(data)
    pos = a
    while pos < end:
        b = pos // size if size else 0
        b0, b1 = b * size, min(total, (b + 1) * size)
        stop = min(end, b1)
        h, nxt = st.open.pop((*key, b), (None, -1))
        if pos == b0:
            h = xxhash.xxh3_64()
        elif nxt != pos:
            h = None  # a block entered in the middle: not verifiable
        if h is not None:
            h.update(data[pos - a : stop - a])  # type: ignore[attr-defined]
            if stop == b1:
                if h.hexdigest() != digests[b]:  # type: ignore[attr-defined]
                    bad.append(key[1])
                st.verified += b1 - b0
            else:
                st.open[(*key, b)] = (h, stop)
        pos = stop


def _host(buf: torch.Tensor) -> torch.Tensor:
    """The bytes on the host, to hash them (a copy for device memory; the seam device digests replace)."""
    return buf if buf.device.type == "cpu" else buf.cpu()


def _hash_bucket(ctx: StageContext, work: Work, st: _State) -> list[str]:
    with ctx.devices.use(work.bucket.devices):
        return _hash_pieces(ctx, work, st)


def _hash_pieces(ctx: StageContext, work: Work, st: _State) -> list[str]:
    bad: list[str] = []
    for p in work.bucket.pieces:
        key = (p.source, p.tensor)
        if p.direct:
            buf = as_bytes(ctx.landing.target(p.scatters[0].param))[p.landing_offset : p.landing_offset + p.nbytes]
        else:
            assert work.lease is not None
            buf = work.lease.view[p.landing_offset : p.landing_offset + p.nbytes]
        mv = memoryview(_host(buf).numpy().data).cast("B")
        item = p.nbytes // max(sum(n for _, n in p.spans), 1)
        at = 0
        for first, count in p.spans:
            _feed(st, key, first * item, mv[at : at + count * item], bad)
            at += count * item
    return bad


async def run(ctx: StageContext, receive: ObjectReceiveStream[Work], send: ObjectSendStream[Work]) -> None:
    st = _State()
    pulled = 0
    async with receive, send:
        async for work in receive:
            ctx.enter("verify")
            t0 = time.perf_counter()
            if not st.specs:
                assert ctx.publication is not None
                for i, m in enumerate(ctx.publication.sources):
                    for s in m.shards:
                        st.specs[(i, s.name)] = s
            bad = await anyio.to_thread.run_sync(_hash_bucket, ctx, work, st)
            if bad:
                assert ctx.attempt is not None
                raise IntegrityError(
                    f"pulled bytes do not match the publisher's digest for {len(bad)} tensor(s): {bad[:20]}",
                    tensor=bad[0],
                    version=ctx.attempt.version,
                )
            await ctx.devices.wait(work.marks)  # apply's copies out of staging are done: it may be reused
            if work.lease is not None:
                ctx.staging.free(work.lease)
                work.lease = None
            work.copies = []
            pulled += work.bucket.nbytes
            ctx.unverified_bytes = pulled - st.verified
            ctx.note("verify", 1, work.bucket.nbytes, time.perf_counter() - t0)
            await send.send(work)
    if ctx.limits.verify == "strict" and ctx.unverified_bytes:  # the plan promised whole blocks only
        raise IntegrityError(
            f"{ctx.unverified_bytes} pulled bytes were not covered by whole digest blocks under verify='strict'",
            version=ctx.attempt.version if ctx.attempt is not None else None,
        )
