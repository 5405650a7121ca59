"""Discover: find the newest complete publication for the receiver's identity, then begin."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import anyio

from refitflow.core.errors import ManifestError, RefitError, RefitTimeoutError, TransportError, VersionError
from refitflow.core.records import Outline
from refitflow.core.threads import off_loop
from refitflow.core.types import Identity, Manifest, Publication
from refitflow.planner.compile_filter import check_compile
from refitflow.refit.attempt import Found, Meter, Resources
from refitflow.refit.transaction import Transaction
from refitflow.registry.protocol import Discovery

__all__ = ["run"]

NEAR_MISS_S = 2.0  # how long a timed-out discovery asks the registry what it holds instead
MAX_UNREADABLE = 64  # versions a receiver remembers it cannot read (the registry's limit on ``skip``)

log = logging.getLogger(__name__)


async def run(
    res: Resources,
    registry: Discovery,
    identity: Identity,
    min_version: int,
    timeout: float,
    begin: Callable[[Publication], Transaction],
    meter: Meter,
) -> Found:
    """Wait (up to ``timeout``) for a complete version ≥ ``min_version``; ``begin`` may refuse it.

    Discovery looks only for the compile targets the receiver accepts, and the compile filter is
    checked before ``begin``, so a refused publication never consumes a version. The wait is not the
    stage's work: it is reported apart (``RefitResult.wait_seconds``).
    """
    meter.enter()
    t_wait = time.perf_counter()
    limits = res.limits
    # a version announced before its digests is read at once, except by a relay (it serves verified bytes)
    early = limits.read_early and not (res.fanout is not None and res.fanout.serve)
    while True:
        try:
            # a registry across the network answers the version as a receiver needs it (core.records.Outline: its
            # layouts, fetched once each; the plan's part of its digests, fetched alone: refit/digests.py)
            pub = await registry.wait_outline(identity, min_version, timeout, compile_targets=limits.compile_targets,
                                              early=early, skip=res.unreadable)  # fmt: skip
        except RefitTimeoutError as exc:
            raise RefitTimeoutError(await _explain(registry, identity, min_version, exc)) from exc
        check_compile(pub, limits)
        try:
            if sum(len(m.shards) for m in pub.manifests) > 1000:  # an address of many regions takes ms to read
                await off_loop(_connect, res, pub)
            else:
                _connect(res, pub)
            break
        except TransportError as exc:  # a source this rank cannot reach (a forged address): the next version
            _unreadable(res.unreadable, pub.version)
            log.warning("version %d is passed over: its sources cannot be reached from here: %s", pub.version,
                        exc)  # fmt: skip
    t0 = time.perf_counter()
    complete = None
    if pub.pending:  # announced before its digests: verify asks for them when it needs them
        complete = lambda: _complete(registry, pub, limits.read_timeout_s)  # noqa: E731
    txn = begin(pub)
    # before the first byte is written: kernels the server queued earlier (on any stream) finish
    await res.devices.quiesce()
    meter.note(1, 0, time.perf_counter() - t0)
    return Found(publication=pub, txn=txn, waited_s=t0 - t_wait, found_at=t0, complete=complete)


def _connect(res: Resources, pub: Publication) -> None:
    """Connect the transport to every source of ``pub``."""
    assert res.transport is not None  # a pulling rank has one
    for m in pub.manifests:
        res.transport.connect(m.source)


def _unreadable(versions: set[int], version: int) -> None:
    """Remember ``version`` as unreadable (the newest ``MAX_UNREADABLE``: what the registry is told to skip)."""
    versions.add(version)
    while len(versions) > MAX_UNREADABLE:
        versions.discard(min(versions))


async def _complete(registry: Discovery, pending: Publication, timeout: float) -> Publication:
    """``pending``'s version with every rank's digests, within ``timeout``; typed errors for a publisher
    that never sends them, or sends another layout (nothing is compared then: the refit aborts)."""
    version = pending.version
    outline = isinstance(pending, Outline)
    try:
        wait = registry.wait_outline if outline else registry.wait_complete
        pub = await wait(pending.identity, version, timeout)
    except RefitTimeoutError as exc:
        raise RefitTimeoutError(f"the digests of version {version} did not follow its announcement within "
                                f"{timeout} s: {exc.reason}", version=version) from exc  # fmt: skip
    if pub.version != version:
        raise VersionError(f"version {pub.version} completed before the digests of version {version} were seen",
                           version=version)  # fmt: skip

    def same() -> bool:  # a rank already complete when the version was found (ranks complete one by one) as it was
        if len(pub.manifests) != len(pending.manifests):
            return False
        pairs = zip(pub.manifests, pending.manifests, strict=True)
        if outline:  # every rank's layout as it was (the revisions of ranks complete then as they were)
            done = zip(getattr(pub, "revisions", ()), getattr(pending, "revisions", ()), strict=False)
            return all(_same_layout(a, b) for a, b in pairs) and all(b in ("", a) for a, b in done)
        return all(full.completes(m) if m.pending else full == m for full, m in pairs)

    many = sum(len(m.shards) for m in pub.manifests) > 1000  # every shard's layout compared: off the loop
    if not (await off_loop(same) if many else same()):
        raise ManifestError("the digests came with another layout than the version announced", version=version)
    return pub


def _same_layout(a: Manifest, b: Manifest) -> bool:
    """Two outlines' manifests of one rank announce one layout (usually the very same shards, fetched once)."""
    return a.source == b.source and a.metadata == b.metadata and (a.shards is b.shards or a.shards == b.shards)


async def _explain(registry: Discovery, identity: Identity, min_version: int, exc: RefitTimeoutError) -> str:
    """The timeout's message, with the full identity and what the registry holds of the model instead."""
    text = f"{exc.reason}; waited for {identity!r}"
    held: list[str] = []
    with anyio.move_on_after(NEAR_MISS_S):
        try:
            held = list(await registry.near_misses(identity, min_version))
        except RefitError:  # the registry did not answer this either: the first message says so
            return text
    return f"{text}; the registry holds: {'; '.join(held)}" if held else text
