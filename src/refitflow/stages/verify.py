"""Verify: hash every pulled byte range against the publisher's digest, then release staging.

A shard's digest streams across its pieces, which arrive in plan order (every stage is one task
over FIFO streams). Staged pieces are hashed in staging, direct pieces where they landed.
"""

from __future__ import annotations

import time

import anyio.to_thread
import xxhash
from anyio.abc import ObjectReceiveStream, ObjectSendStream

from refitflow.core.errors import IntegrityError
from refitflow.stages._context import StageContext, Work
from refitflow.transports.base import as_bytes

__all__ = ["run"]


def _hash_bucket(ctx: StageContext, work: Work, hashers: dict, digests: dict) -> list[str]:
    """Feed the bucket's pieces to their shard hashers; return the tensors whose digest failed.

    Digests come from this version's manifests (a replayed plan holds no bytes-dependent data).
    """
    bad = []
    for p in work.bucket.pieces:
        key = (p.source, p.tensor)
        if p.first:
            hashers[key] = xxhash.xxh3_64()
        if p.direct:
            pulled = as_bytes(ctx.landing.target(p.param))[p.landing_offset : p.landing_offset + p.nbytes]
        else:
            assert work.lease is not None
            pulled = work.lease.view[p.landing_offset : p.landing_offset + p.nbytes]
        hashers[key].update(pulled.numpy().data)
        if p.last and hashers.pop(key).hexdigest() != digests[key]:
            bad.append(p.tensor)
    return bad


async def run(ctx: StageContext, receive: ObjectReceiveStream[Work], send: ObjectSendStream[Work]) -> None:
    hashers: dict = {}
    digests: dict = {}
    async with receive, send:
        async for work in receive:
            ctx.enter("verify")
            t0 = time.perf_counter()
            if not digests:
                assert ctx.publication is not None
                digests = {(i, s.name): s.digest for i, m in enumerate(ctx.publication.sources) for s in m.shards}
            bad = await anyio.to_thread.run_sync(_hash_bucket, ctx, work, hashers, digests)
            if bad:
                assert ctx.attempt is not None
                raise IntegrityError(
                    f"pulled bytes do not match the publisher's digest for {len(bad)} tensor(s): {bad[:20]}",
                    tensor=bad[0],
                    version=ctx.attempt.version,
                )
            if work.lease is not None:
                ctx.staging.free(work.lease)
                work.lease = None
            work.copies = []
            ctx.note("verify", 1, work.bucket.nbytes, time.perf_counter() - t0)
            await send.send(work)
