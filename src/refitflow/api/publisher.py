"""Publisher: a trainer rank announces each version of its shards; receivers read them in place.

The publisher never copies or mutates the trainer's tensors. It registers each tensor's whole storage
with the transport, once (a new storage is registered anew, and the address re-announced): tensors that
are views of one buffer (Megatron's DDP buffers) share a region at their offsets, so receivers read
neighbouring tensors as one read and the transport holds one registration per buffer. It then
digests the bytes and publishes a manifest. The trainer must not change the tensors of a version
until ``await pub.released(version)`` returns.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import TracebackType
from typing import Any

import anyio.to_thread
import torch

from refitflow.api._sharded import Sharded
from refitflow.api.digesting import (
    DIGEST_CHOICES,
    Digests,
    _digest_one_at_a_time,
    _tiling,
    digest_algorithm,
    digest_columns,
    pending_columns,
)
from refitflow.api.dtensor import is_dtensor, local_part
from refitflow.api.transport import choose_transport
from refitflow.core.columns import specs_of_columns
from refitflow.core.dtypes import dtype_name
from refitflow.core.errors import ConfigError, VersionError
from refitflow.core.threads import off_loop
from refitflow.core.types import Identity, Manifest
from refitflow.layouts.quant_layout import quant_metadata
from refitflow.metrics import NULL_OBSERVER, PublishObserver
from refitflow.refit.device import check_device, devices_of, mark_current, wait_marks
from refitflow.registry.client.connect import connect_registry
from refitflow.registry.keys import DeploymentKeys
from refitflow.registry.protocol import Publishing
from refitflow.registry.release import ReleasePolicy
from refitflow.registry.security import ClientSecurity
from refitflow.transports import Transport, make_transport

__all__ = ["Publisher", "Sharded"]


_LAYOUT_FIELDS = ("dtype", "global_shape", "axis", "start", "stop")  # what ``_spec`` gives of each tensor
EARLY_CHANGED = 0.99  # announce early (``announce_early=None``) after a version that changed this share of bytes


class Publisher:
    """One trainer rank: announces each version of its tensors; receivers read them where they lie.

    Use it inside ``async with``::

        async with rf.Publisher("tcp://127.0.0.1:7100", identity=rf.Identity(model="m")) as pub:
            await pub.publish(1, dict(model.named_parameters()))
            await pub.released(1)          # every registered receiver is done: the step may change them

    Arguments:

    - ``registry``: an ``rf.Registry`` (in this process), an ``rf.RegistryClient``, or the address of a
      registry service (``"tcp://host:port"``; a client is opened and closed with the publisher).
    - ``identity``: what receivers look for (``rf.Identity``: model, layout, dtype, parallelism, compile
      target); a receiver finds this publication only under the very same identity.
    - ``rank``, ``world_size``: this trainer rank among the ranks that publish one version together; a
      version is discoverable once all ``world_size`` ranks published it.
    - ``transport``: ``"auto"`` (default: ``"loopback"`` with a registry object, ``"nixl"`` with an address
      or client), ``"loopback"`` (this process only), ``"nixl"``, or a ``Transport`` instance.
    - ``metadata``: announced with every manifest (``metadata["layout"]``: the layout the tensors are in,
      from ``refitflow.layouts.wire.layout_metadata``); receivers may filter on it.
    - ``compile_target``, ``compile_metadata``: what the bytes were compiled for (receivers may filter).
    - ``observer``: metrics (``refitflow.metrics.prometheus.PrometheusMetrics``).
    - ``release_policy``: when ``released(version)`` returns (``rf.ReleasePolicy``; default: every
      registered receiver is done with the version).
    - ``digest``: the digest algorithm — ``"auto"`` (mix64 for tensors on an accelerator, xxh3 on the
      CPU), ``"xxh3"``, or ``"mix64"`` (a CPU trainer whose receivers verify on GPUs; docs/architecture.md).
    - ``column_digests`` (True): digest column ranges too, so a receiver reading a column slice (TP of a
      row-parallel weight) verifies just its slice. False: one digest per block of rows — one contiguous
      pass, 1.7–2.3× faster (``bench/digest_bench.py``) — announced in ``metadata["digests"]``;
      a receiver that would read a column slice then refuses the publication (``PlanError``). For
      deployments whose receivers hold whole rows (DP, EP, row-sliced TP only).
    - ``announce_early`` (None: auto): two-phase publication — announce each version's layout before
      digesting it, then its digests: receivers (``read_early``, their default) start reading while the
      trainer hashes, and compare every byte once the digests arrive. Receivers skip nothing of such a
      version as unchanged (delta refits), so ``None`` announces early only where that costs nothing: after
      a version that changed at least ``EARLY_CHANGED`` (99 %) of this rank's bytes against the one before
      (full fine-tuning), and not again after one that kept more unchanged (frozen layers, LoRA bases) — at
      most one version's delta is lost when training starts freezing. True / False: always / never.

    - ``security``: CURVE for a registry given by address: the deployment's keys (``rf.DeploymentKeys``, e.g.
      ``rf.find_keys(os.environ, Path.home())``: the folder ``refitflow registry`` made; the publisher presents
      its ``trainer`` pair) or an ``rf.ClientSecurity``; None: no CURVE.

    Errors: ``ConfigError`` for arguments that make no sense (raised here, before anything starts);
    ``VersionError`` for a version that does not increase or a republish with other content.
    """

    def __init__(
        self,
        registry: Publishing | str,
        *,
        identity: Identity,
        rank: int = 0,
        world_size: int = 1,
        transport: str | Transport = "auto",
        metadata: Mapping[str, str] | None = None,
        compile_target: str = "",
        compile_metadata: Mapping[str, str] | None = None,
        observer: PublishObserver = NULL_OBSERVER,
        release_policy: ReleasePolicy | None = None,
        digest: str = "auto",
        announce_early: bool | None = None,
        security: ClientSecurity | DeploymentKeys | None = None,
        column_digests: bool = True,
    ) -> None:
        if not isinstance(identity, Identity):
            raise ConfigError(f"identity must be an rf.Identity, got {type(identity).__name__}")
        if not 0 <= rank < world_size:
            raise ConfigError(f"rank {rank} must lie in [0, world_size={world_size})")
        if digest not in DIGEST_CHOICES:
            raise ConfigError(f"digest must be one of {list(DIGEST_CHOICES)}, got {digest!r}")
        self._digest_choice = digest
        self.announce_early = announce_early
        self.announced_early = False  # whether the last publish announced its layout before its digests
        self._digests: dict[str, str] = {}  # the last version's digest of each tensor (``announce_early=None``)
        self._changed: float | None = None  # the share of bytes the last version changed against the one before
        self.column_digests = column_digests
        transport = choose_transport(transport, registry)
        self._owns_registry = isinstance(registry, str)
        self.registry: Publishing = connect_registry(registry, security, "trainer")
        self.release_policy = release_policy
        self.identity = identity
        self.rank = rank
        self.world_size = world_size
        self.metadata = dict(metadata or {})
        self.compile = dict(
            compile_target=compile_target, compile_metadata=tuple(sorted((compile_metadata or {}).items()))
        )
        self.observer = observer
        self._transport_spec = transport
        self._transport: Transport | None = None
        self._regions_by_version: dict[int, set[int]] = {}
        self._known_regions: set[int] = set()
        self._storages: dict[tuple[int, int, int], int] = {}  # (device, address, bytes) of a storage -> its region
        self.published: list[int] = []

    async def __aenter__(self) -> Publisher:
        try:
            # off the loop: a real transport imports its library and creates its agent (seconds)
            self._transport = await anyio.to_thread.run_sync(make_transport, self._transport_spec)
        except BaseException:
            await self._close()  # a failed enter leaks nothing (an owned registry client included)
            raise
        transport = self._transport
        self.observer.watch_served(lambda: transport.served_bytes)
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self._close()

    async def _close(self) -> None:
        with anyio.CancelScope(shield=True):
            try:
                if self._transport is not None:
                    await self._transport.aclose()
            finally:
                self._transport = None
                if self._owns_registry:
                    await self.registry.aclose()  # type: ignore[attr-defined]

    @property
    def transport(self) -> Transport:
        if self._transport is None:
            raise ConfigError("use the publisher inside 'async with'")
        return self._transport

    def _spec(self, name: str, value: Any) -> tuple[torch.Tensor, tuple[Any, ...]]:
        """The tensor to publish for ``value`` and its layout fields (dtype, global shape, axis, start, stop)."""
        if isinstance(value, Sharded):
            tensor, axis, start = value.tensor, value.axis, value.start
            shape = tuple(value.global_shape)
            stop = start + tensor.shape[axis]
        elif isinstance(value, torch.Tensor):
            tensor, axis, shape = value, None, tuple(value.shape)
            start, stop = 0, (shape[0] if shape else 1)
        else:
            raise ConfigError(f"{name!r}: expected a tensor or rf.Sharded, got {type(value).__name__}")
        if not tensor.is_contiguous():
            raise ConfigError(f"{name!r} is not contiguous; refitflow never copies the trainer's tensors")
        data = tensor.detach() if tensor.requires_grad else tensor  # (a state_dict's tensors are detached already)
        return data, (dtype_name(tensor.dtype, tensor=name), shape, axis, start, stop)

    async def publish(self, version: int, tensors: Mapping[str, torch.Tensor | Sharded], *,
                      metadata: Mapping[str, str] | None = None, quant: Mapping[str, str] | None = None,
                      ) -> Manifest:  # fmt: skip
        """Register, digest and announce this rank's tensors as ``version`` (greater than the last one).

        ``tensors``: name -> tensor (the whole tensor), ``rf.Sharded`` (this rank's part of it), or a
        ``DTensor`` (an FSDP2 parameter: its local part, placed by its placements — ``api/dtensor.py``;
        a rank whose chunk is empty publishes nothing for it). The tensors must stay unchanged until
        ``await released(version)`` returns. ``metadata``: this version's own entries, announced over the
        publisher's (e.g. the base version a LoRA adapter was trained on).

        Quantised tensors (``layouts/quant.py``) are published as they are, values beside scales: a float8
        ``W`` with a float32 ``W_scale_inv`` of 128×128 blocks is ``fp8_block128``, and so on; ``quant``
        names a tensor's format where its dtypes cannot tell (``{"W": "fp8_block128_pow2"}``, ``"nvfp4"``).
        The pairs are announced in ``metadata["quant"]``; receivers copy them, or convert (``docs/quant.md``).
        """
        if self.published and version <= self.published[-1]:
            raise VersionError(
                f"this publisher already published version {self.published[-1]}; publish a greater version",
                version=version,
            )
        if not isinstance(tensors, Mapping):
            raise ConfigError(f"tensors must be a mapping of names to tensors, got {type(tensors).__name__}")
        many = len(tensors) > 1024  # then the per-tensor Python runs in a worker thread, off a busy loop
        meta = {**self.metadata, **(metadata or {})}
        if "quant" in meta or "digests" in meta:
            raise ConfigError("metadata['quant'] and ['digests'] are refitflow's: pass quant= to publish, "
                              "column_digests= to the Publisher")  # fmt: skip
        if not self.column_digests:
            meta["digests"] = "rows"

        def specs() -> list[tuple[str, torch.Tensor, tuple[Any, ...]]]:  # every check before anything is registered
            parts = {name: local_part(name, value) for name, value in tensors.items()}
            # a DTensor whose chunk on this rank is empty: nothing to publish for it
            return [(name, *self._spec(name, value)) for name, value in parts.items()
                    if value is not None or not is_dtensor(tensors[name])]  # fmt: skip

        prepared = await off_loop(specs) if many else specs()
        names = [name for name, _, _ in prepared]
        held = [t for _, t, _ in prepared]
        devices = devices_of(held)
        for device in devices:  # before anything is registered
            check_device(device, repr(next(n for n, t in zip(names, held, strict=True) if t.device == device)))
        meta |= quant_metadata(dict(zip(names, held, strict=True)), quant, meta)
        step = mark_current(devices)  # the trainer's work, as queued on its streams
        regions, offsets = zip(*(self._register(t) for t in held), strict=True) if held else ((), ())
        await wait_marks(step)  # off the loop: digests and peers read the finished step
        source = self.transport.address()
        items = [(t, digest_algorithm(t, self._digest_choice)) for t in held]
        tilings = [_tiling(t, algo, self.column_digests) for t, algo in items]
        # the specs a column at a time (``core.columns``): the layout's columns once, the digests' per message
        columns: dict[str, list[Any]] = {"name": names, "region": list(regions), "offset": list(offsets)}
        columns |= {f: [fields[k] for _, _, fields in prepared] for k, f in enumerate(_LAYOUT_FIELDS)}
        columns |= {f: [v] * len(names) for f, v in self.compile.items()}

        def build(fields: list[Digests] | None, pending: Manifest | None) -> Manifest:
            """Every spec checked a column at a time (the complete manifest of an early announcement has the same
            layout as the pending one: its layout digest is kept)."""
            digests = pending_columns(tilings) if fields is None else digest_columns(fields)  # pending: geometry
            return Manifest(identity=self.identity, version=version, rank=self.rank, world_size=self.world_size,
                            source=source, shards=specs_of_columns(columns | digests), metadata=meta,
                            layout_digest=pending.layout_digest if pending is not None else "")  # fmt: skip

        async def announce(fields: list[Digests] | None, pending: Manifest | None = None) -> Manifest:
            manifest = await off_loop(build, fields, pending) if many else build(fields, pending)
            await self.registry.publish(manifest)
            return manifest

        self.announced_early = self.announces_early
        # the layout first: receivers read while the digests are computed
        pending = await announce(None) if self.announced_early else None
        fields = await anyio.to_thread.run_sync(_digest_one_at_a_time, items, self.column_digests, tilings)
        manifest = await announce(fields, pending)
        sizes = [t.numel() * t.element_size() for t in held]
        if self.announce_early is None:
            self._learn_changes(names, sizes, [d[-1] for d in fields])  # (the digest is last)
        self.observer.version_published(version, sum(sizes))
        self.published.append(version)
        self._regions_by_version[version] = set(regions)
        self._known_regions |= set(regions)
        await self._forget_released()
        return manifest

    def _register(self, tensor: torch.Tensor) -> tuple[int, int]:
        """The region of ``tensor``'s whole storage and the tensor's byte offset in it. A storage registered
        before is looked up by its address (the transport holds it while registered, so the address is its
        own), not viewed whole again: that view was a quarter of ``publish()``'s cost per tensor."""
        storage = tensor.untyped_storage()
        key = (tensor.get_device(), storage.data_ptr(), storage.nbytes())
        region = self._storages.get(key)
        if region is None:
            whole = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)
            region = self._storages[key] = self.transport.register(whole)
        return region, int(tensor.storage_offset()) * tensor.element_size()

    @property
    def announces_early(self) -> bool:
        """Whether the next ``publish`` announces its layout before its digests (``announce_early``)."""
        if self.announce_early is not None:
            return self.announce_early
        return self._changed is not None and self._changed >= EARLY_CHANGED

    def _learn_changes(self, names: list[str], sizes: list[int], digests: list[str]) -> None:
        """The share of this version's bytes whose digest differs from the last version's (auto announce)."""
        last, total = self._digests, sum(sizes)
        changed = sum(n for name, n, d in zip(names, sizes, digests, strict=True) if last.get(name) != d)
        self._changed = changed / total if last and total else None
        self._digests = dict(zip(names, digests, strict=True))

    async def released(self, version: int, timeout: float | None = None) -> None:
        """Return when ``version`` is released per the release policy (its tensors may change then)."""
        await self.registry.wait_released(self.identity, version, timeout, policy=self.release_policy)
        done, registered = await self.registry.acked(self.identity, version)
        self.observer.receivers_acked(done, registered)

    async def _forget_released(self) -> None:
        """Deregister memory only released versions still referenced."""
        latest = self.published[-1]
        for version in [v for v in self._regions_by_version if v != latest]:
            if await self.registry.is_released(self.identity, version, policy=self.release_policy):
                del self._regions_by_version[version]
        keep: set[int] = set().union(*self._regions_by_version.values())
        for region in self._known_regions - keep:
            self.transport.deregister(region)
        if self._known_regions - keep:
            self._storages = {k: r for k, r in self._storages.items() if r in keep}
        self._known_regions = keep
