"""A preparer that processes a vLLM model's transformed layers before the vote and installs them at the commit.

``Reprocessing`` wraps the direct writer's ``Receiver`` (a ``Preparer``, ``engine.member``): ``prepare`` pulls
and verifies the version into the live parameters' shadows and the transformed layers' loading-layout
staging, then runs vLLM's reload steps for each such layer on a detached copy (``kernels.process``, off the
event loop) — a processing failure fails this rank's ballot, so the engine aborts cleanly and the previous
version serves on — ``finish`` commits the receiver and installs every processed layer (``kernels.install``),
``abort`` drops them; an install that fails fences the rank. Installing is a copy into each kernel tensor
and an attribute move: a no-drain swap between two steps stays short however long vLLM's processing takes.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import anyio.to_thread

from refitflow.core.errors import RefitError
from refitflow.engine.member import Preparer
from refitflow.integrations.hosting.rank_session import Build, SessionConfig
from refitflow.integrations.vllm.worker import kernels
from refitflow.refit.transaction import Transaction

__all__ = ["Reprocessing", "reprocessing"]


class Reprocessing:
    def __init__(self, inner: Any, layers: list[kernels.KernelLayer]) -> None:
        self.inner, self.layers = inner, layers
        self.ledger = inner.ledger
        self._made: dict[int, list[kernels.Processed]] = {}  # id(txn) -> its processed layers

    def __getattr__(self, name: str) -> Any:  # destination, status, ... of the receiver
        return getattr(self.inner, name)

    async def prepare(self, min_version: int | None = None, *, timeout: float = 60.0) -> tuple[Transaction, Any]:
        txn, result = await self.inner.prepare(min_version, timeout=timeout)
        target = self.inner.destination.target  # the verified bytes: the shadow, or the staging in place
        try:
            made = await anyio.to_thread.run_sync(self._process_all, target)
        except Exception as exc:
            reason = f"vLLM's processing of the new version failed: {type(exc).__name__}: {exc}"
            await self.inner.abort(txn, reason)
            raise RefitError(reason, version=txn.version) from exc
        self._made[id(txn)] = made
        return txn, result

    def _process_all(self, target: Any) -> list[kernels.Processed]:
        out = []
        for layer in self.layers:
            time.sleep(0.001)  # vLLM's processing may hold the GIL for a whole layer: the engine's steps go between
            staged = {local: target(f"{layer.name}.{local}") for local in layer.loading}
            try:
                out.append(kernels.process(layer, staged))
            except Exception as exc:
                raise RefitError(f"{layer.name} ({layer.method}): {type(exc).__name__}: {exc}") from exc
        return out

    async def finish(self, txn: Transaction) -> None:
        made = self._made.pop(id(txn), [])
        await self.inner.finish(txn)
        try:
            for processed in made:  # on the caller's turn, between two of the engine's steps
                kernels.install(processed)
        except Exception as exc:  # committed, partly installed: this rank must not serve it
            reason = f"installing the processed layers of version {txn.version} failed: {type(exc).__name__}: {exc}"
            self.ledger.fence_for_peers(reason)
            raise RefitError(reason, version=txn.version) from exc

    async def abort(self, txn: Transaction, reason: str) -> None:
        self._made.pop(id(txn), None)
        await self.inner.abort(txn, reason)


def reprocessing(build: Build, layers: list[kernels.KernelLayer]) -> Build:
    """``build`` whose preparer processes ``layers`` before the vote and installs them at the commit."""

    async def wrapped(config: SessionConfig, stack: contextlib.AsyncExitStack) -> Preparer:
        inner = await build(config, stack)
        return Reprocessing(inner, layers) if layers else inner

    return wrapped
