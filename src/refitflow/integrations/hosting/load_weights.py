"""The ``load_weights`` writer: whole HF-named tensors through the model's own loader, in buckets.

For a model refitflow cannot map (quantised formats it does not know, custom modules), a rank pulls
the publication's canonical tensors whole — in buckets of at most ``budget_bytes``, landing in one
reused window — verifies them, and hands each bucket to the model's ``load_weights``, which shards,
fuses and quantises as it does at start-up. The whole version is one refitflow transaction
(``Ledger`` over the live parameters): it begins before the first bucket; coverage counts the
parameters ``load_weights`` reports loaded (every parameter of the model must be reported); then
the engine vote. A failure after the first bucket was loaded leaves the rank fenced (``in_place``)
or restores the copy taken at begin (``shadow``: one more copy of the model while it runs).

Every rank reads the whole tensors (not its slice): this mode costs TP times the bytes of
``direct``. A ``load`` with ``begin()`` and ``end(failed)`` has them called around each version's buckets
(vLLM's layerwise reload: ``integrations/vllm/worker/reload.py``). Stacked canonical experts are fed per expert,
under the model family's checkpoint names.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.to_thread
import torch

from refitflow.api.receiver import Receiver
from refitflow.api.transport import choose_transport
from refitflow.core.dtypes import dtype_from_name
from refitflow.core.errors import ConfigError, RefitError
from refitflow.core.types import Publication, SourceAddress
from refitflow.engine.member import Preparer
from refitflow.integrations.hosting.rank_session import Build, SessionConfig
from refitflow.layouts.canonical import sliced
from refitflow.layouts.wire import resolve
from refitflow.refit.config import ReceiverConfig
from refitflow.refit.destination import ApplyMode, Destination
from refitflow.refit.fence import Fence, FenceState
from refitflow.refit.transaction import Ledger, Transaction
from refitflow.registry.client.client import RegistryClient
from refitflow.transports import Read, Transport, make_transport

__all__ = ["EXPERT_NAMES", "BucketLoader", "checkpoint_names", "load_weights_writer", "published_tensors"]

# stacked canonical experts -> per-expert checkpoint names, by module family
EXPERT_NAMES = {
    "mlp": {"gate": "mlp.experts.{e}.gate_proj.weight", "up": "mlp.experts.{e}.up_proj.weight",
            "down": "mlp.experts.{e}.down_proj.weight"},
    "block_sparse_moe": {"gate": "block_sparse_moe.experts.{e}.w1.weight",
                         "up": "block_sparse_moe.experts.{e}.w3.weight",
                         "down": "block_sparse_moe.experts.{e}.w2.weight"},
}  # fmt: skip
_ALIGN = 256

Load = Callable[[Iterable[tuple[str, torch.Tensor]]], Any]


def published_tensors(pub: Publication) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every canonical tensor of a publication, with its shape and dtype, in publication order."""
    out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for m in pub.manifests:
        dtypes = {s.name: dtype_from_name(s.dtype) for s in m.shards}
        if "layout" not in m.metadata:
            for s in m.shards:
                out.setdefault(s.name, (tuple(s.global_shape), dtypes[s.name]))
            continue
        layout, shapes = resolve(m.metadata["layout"])
        for local, lt in layout.items():
            for seg in lt.segments:
                if local in dtypes:
                    out.setdefault(seg.canonical, (shapes[seg.canonical], dtypes[local]))
    return out


def checkpoint_names(name: str, tensor: torch.Tensor, family: str) -> list[tuple[str, torch.Tensor]]:
    """A canonical tensor under the names a model's ``load_weights`` takes: stacked experts one each, and
    the MoE block under the family's module name (Mixtral's router: ``block_sparse_moe.gate.weight``)."""
    head, _, leaf = name.rpartition(".mlp.experts.")
    if not head or leaf not in ("gate", "up", "down"):
        return [(name if family == "mlp" else name.replace(".mlp.", f".{family}."), tensor)]
    pattern = EXPERT_NAMES[family][leaf]
    return [(f"{head}.{pattern.format(e=e)}", tensor[e]) for e in range(tensor.shape[0])]


@dataclass(frozen=True)
class _Bucket:
    names: tuple[str, ...]
    receiver: Receiver


class _Shared(Transport):
    """One transport for every bucket's receiver: registrations are kept, closing is the owner's. Memory inside
    a window the owner registered (``cover``) is that window's region: every bucket's views overlap in one
    window, and NIXL does not find a range among overlapping registrations (``NIXL_ERR_NOT_FOUND``)."""

    def __init__(self, inner: Transport) -> None:
        self.inner = inner
        self.name = inner.name
        self._windows: dict[int, tuple[int, int]] = {}  # region -> [start, end) of a window

    @property
    def agent(self) -> str:
        return self.inner.agent

    def cover(self, window: torch.Tensor) -> None:
        """Register ``window`` once; every view of it registered later is this region."""
        start = window.data_ptr()
        self._windows[self.inner.register(window)] = (start, start + window.numel() * window.element_size())

    def register(self, tensor: torch.Tensor) -> int:
        start = tensor.data_ptr()
        end = start + tensor.numel() * tensor.element_size()
        for region, (a, b) in self._windows.items():
            if a <= start and end <= b:
                return region
        return self.inner.register(tensor)

    def deregister(self, region: int) -> None:
        if region not in self._windows:
            self.inner.deregister(region)

    def address(self) -> SourceAddress:
        return self.inner.address()

    def connect(self, source: SourceAddress) -> None:
        self.inner.connect(source)

    async def read(self, reads: Sequence[Read], *, key: Hashable | None = None, count: bool = True) -> None:
        await self.inner.read(reads, key=key, count=count)

    async def aclose(self) -> None:
        return None


class BucketLoader:
    """A ``Preparer`` (``engine.member``) for a ``RankSession``: buckets of whole tensors → verify →
    ``load_weights``, one transaction over the live parameters; the session's ``EngineMember`` votes."""

    def __init__(
        self, params: Iterable[tuple[str, torch.Tensor]], load: Load, config: SessionConfig,
        stack: contextlib.AsyncExitStack, transport: _Shared, registry: RegistryClient, family: str,
    ) -> None:  # fmt: skip
        self.load, self.config, self.stack = load, config, stack
        self.transport, self.registry, self.family = transport, registry, family
        self.fence = Fence()
        # where the buckets start (ConfigError out of range): from the first that starts at that fraction of
        # the bytes, wrapping round (each bucket's receiver is given it too: it joins no relays)
        self.read_start = ReceiverConfig(read_start=config.receiver_options.get("read_start", 0.0)).read_start
        # the transaction counts what load_weights reports over the live parameters, as bytes: any dtype
        # (quantised formats included) is written and restored the same way
        views = {n: p.detach().reshape(-1).view(torch.uint8) for n, p in params}
        self.ledger = Ledger(Destination(views, ApplyMode.IN_PLACE), self.fence)
        self.buckets: list[_Bucket] = []
        self._key: tuple[Any, ...] | None = None
        self._window: torch.Tensor | None = None
        self._backup: dict[str, torch.Tensor] = {}

    async def _plan(self, tensors: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> None:
        """Cut the tensors into buckets of at most the budget (a larger tensor: alone), views of one window."""
        key = tuple((n, s, str(d)) for n, (s, d) in tensors.items())
        if key == self._key:
            return
        groups: list[list[tuple[str, int]]] = [[]]
        used, starts = 0, [0]  # starts: the bytes of the publication before each group
        for name, (shape, dtype) in tensors.items():
            nbytes = -(-torch.Size(shape).numel() * dtype.itemsize // _ALIGN) * _ALIGN
            if groups[-1] and used + nbytes > self.config.budget_bytes:
                groups.append([])
                starts.append(starts[-1] + used)
                used = 0
            groups[-1].append((name, used))
            used += nbytes
        size = max(off + torch.Size(tensors[n][0]).numel() * tensors[n][1].itemsize for g in groups for n, off in g)
        device = next(iter(self.ledger.destination.params.values())).device
        self._window = torch.empty(max(size, self.config.budget_bytes), dtype=torch.uint8, device=device)
        self.transport.cover(self._window)
        staging = max(1 << 16, self.config.budget_bytes // 4)
        own = ("shadow_commit", "serve_replicas")
        # read_start stays in each bucket's options: a bucket receiver given one joins no relays (Receiver)
        options = {k: v for k, v in self.config.receiver_options.items() if k not in own}
        first = next((i for i, start in enumerate(starts) if start >= self.read_start * (starts[-1] + used)), 0)
        # every bucket's views share one window, rewritten by the next bucket: nothing is held there between
        # versions (no delta refit) and nothing can be relayed from it
        options["skip_unchanged"] = False
        self.buckets = []
        for i, group in enumerate(groups):
            views = {n: self._view(tensors[n], off) for n, off in group}
            layout = {n: sliced(n, tensors[n][0]) for n in views}  # whole tensors, a subset of the publication
            receiver = Receiver(
                views, self.registry, identity=self.config.identity, transport=self.transport, mode="in_place",
                budget_bytes=staging, receiver_id=f"{self.config.receiver_id}-b{i}", layout=layout, **options,
            )  # fmt: skip
            await self.stack.enter_async_context(receiver)
            self.buckets.append(_Bucket(tuple(views), receiver))
        self.buckets = self.buckets[first:] + self.buckets[:first]
        self._key = key

    def _view(self, spec: tuple[tuple[int, ...], torch.dtype], offset: int) -> torch.Tensor:
        assert self._window is not None
        shape, dtype = spec
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        return self._window[offset : offset + nbytes].view(dtype).view(shape)

    async def prepare(self, min_version: int | None = None, *, timeout: float = 60.0) -> tuple[Transaction, None]:
        """Load the newest complete version ≥ ``min_version`` through ``load_weights`` and check coverage;
        on failure the transaction is aborted (in place fenced once a bucket was loaded; shadow restored)."""
        try:
            return await self._load(min_version or 0, timeout), None
        except BaseException as exc:
            if self.ledger.open is not None:
                self._abort(self.ledger.open, f"{type(exc).__name__}: {exc}")
            if isinstance(exc, RefitError) or not isinstance(exc, Exception):
                raise
            # the model's load_weights, a shape it refuses: a typed error, chained
            raise RefitError(f"load_weights failed: {type(exc).__name__}: {exc}", version=min_version) from exc

    async def _load(self, version: int, wait_s: float) -> Transaction:
        pub = await self.registry.wait_complete(self.config.identity, version, wait_s)
        await self._plan(published_tensors(pub))
        txn = self.ledger.begin(pub.version, pub.revision)
        if self.config.mode == "shadow":
            params = self.ledger.destination.params
            self._backup = await anyio.to_thread.run_sync(lambda: {n: t.detach().clone() for n, t in params.items()})
        loaded: set[str] = set()
        begin, end = getattr(self.load, "begin", None), getattr(self.load, "end", None)
        if begin is not None:
            await anyio.to_thread.run_sync(begin)
        try:
            await self._buckets(pub.version, wait_s, txn, loaded)
        except BaseException:
            if end is not None:
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(end, True)
            raise
        if end is not None:
            await anyio.to_thread.run_sync(end, False)
        for name, tensor in self.ledger.destination.params.items():
            if name in loaded:
                txn.coverage.record(name, "load_weights", tensor.numel())
        self.ledger.prepare(txn)  # CoverageError: a parameter load_weights never reported
        return txn

    async def _buckets(self, version: int, wait_s: float, txn: Transaction, loaded: set[str]) -> None:
        """Every bucket of ``version``: pulled, verified, handed to ``load``; what it reported goes into ``loaded``."""
        for bucket in self.buckets:
            got, _ = await bucket.receiver.prepare(version, timeout=wait_s)
            if got.version != version:  # a newer version appeared mid-way: never mix two
                await bucket.receiver.abort(got, "another version than the rest of the buckets")
                raise RefitError(f"bucket got version {got.version}, not {version}", version=version)
            await bucket.receiver.finish(got)
            named = [p for n in bucket.names for p in checkpoint_names(n, bucket.receiver.destination.params[n],
                                                                        self.family)]  # fmt: skip
            txn.wrote = True
            reported = await anyio.to_thread.run_sync(self.load, named)
            if reported is None:
                raise ConfigError("the model's load_weights does not report what it loaded: coverage cannot be checked")
            loaded |= set(reported)

    def _abort(self, txn: Transaction, reason: str) -> None:
        self.ledger.abort(txn, reason)
        if self._backup:  # shadow: the previous version back in place
            for name, tensor in self.ledger.destination.params.items():
                tensor.detach().copy_(self._backup[name])
            self._backup = {}
            self.fence.set(FenceState.READY)

    async def finish(self, txn: Transaction) -> None:
        self.ledger.finish(txn)
        self._backup = {}

    async def abort(self, txn: Transaction, reason: str) -> None:
        self._abort(txn, reason)


def load_weights_writer(params: Iterable[tuple[str, torch.Tensor]], load: Load, family: str) -> Build:
    """``build`` for ``RankSession.open``: a ``BucketLoader`` over ``params`` (the model's parameters less
    any the engine derives itself) feeding ``load`` (the model's ``load_weights``)."""
    if family not in EXPERT_NAMES:
        raise ConfigError(f"expert naming must be one of {sorted(EXPERT_NAMES)}, got {family!r}")
    params = list(params)

    async def build(config: SessionConfig, stack: contextlib.AsyncExitStack) -> Preparer:
        name = choose_transport(config.transport, config.registry)
        transport = await anyio.to_thread.run_sync(make_transport, name)
        stack.push_async_callback(transport.aclose)
        registry = RegistryClient(config.registry, security=config.security)
        stack.push_async_callback(registry.aclose)
        return BucketLoader(params, load, config, stack, _Shared(transport), registry, family)

    return build
