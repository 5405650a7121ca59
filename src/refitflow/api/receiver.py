"""Receiver: an inference rank that refits its model to the newest complete version, transactionally."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Mapping
from dataclasses import replace
from types import TracebackType
from typing import Any

import anyio
import anyio.to_thread
import torch

from refitflow.api.transport import choose_transport
from refitflow.core.errors import (
    RELEASED_HINT,
    ConfigError,
    IntegrityError,
    RefitError,
    RefitTimeoutError,
    VersionError,
)
from refitflow.core.threads import off_loop
from refitflow.core.types import Identity
from refitflow.layouts.canonical import LocalTensor
from refitflow.metrics import NULL_OBSERVER, Observer
from refitflow.planner.records import Plan
from refitflow.refit.arena import StagingArenas
from refitflow.refit.attempt import Resources
from refitflow.refit.config import ReceiverConfig
from refitflow.refit.destination import Destination
from refitflow.refit.device import DeviceLane, Marks
from refitflow.refit.fanout.relaying import Relaying
from refitflow.refit.graph import run_pipeline
from refitflow.refit.plans import PlanCache
from refitflow.refit.rank import RankState
from refitflow.refit.results import ReceiverStatus, RefitResult, StageStats, refit_result
from refitflow.refit.transaction import Transaction
from refitflow.registry.client.connect import connect_registry
from refitflow.registry.keys import DeploymentKeys
from refitflow.registry.protocol import Discovery
from refitflow.registry.security import ClientSecurity
from refitflow.transports import Transport, make_transport

__all__ = ["Receiver", "ReceiverStatus", "RefitResult", "StageStats"]

log = logging.getLogger(__name__)


class Receiver:
    """One inference rank: refits its model to each new version, transactionally.

    Use it inside ``async with``::

        async with rf.Receiver(model, "tcp://127.0.0.1:7100", identity=rf.Identity(model="m")) as recv:
            result = await recv.refit()     # the newest complete version newer than the last one
            recv.fence.check()              # rf.FencedError unless a complete version is serving

    Arguments:

    - ``model``: a ``torch.nn.Module`` or a mapping of names to tensors: the parameters to write. Without
      ``layout`` the names are the publisher's tensor names.
    - ``registry``: an ``rf.Registry`` (in this process), an ``rf.RegistryClient``, or the address of a
      registry service (``"tcp://host:port"``; a client is opened and closed with the receiver).
    - ``identity``: the ``rf.Identity`` to look for; it must equal the publisher's.
    - ``transport``: ``"auto"`` (default: ``"loopback"`` with a registry object, ``"nixl"`` with an address
      or client), ``"loopback"`` (this process only), ``"nixl"``, or a ``Transport`` instance.
    - ``mode``: ``"in_place"`` (write the live parameters behind the fence; a failure leaves the rank
      fenced) or ``"shadow"`` (write a copy and swap at commit; a failure leaves the old version serving,
      at twice the parameter memory).
    - ``budget_bytes``: the staging memory this rank may hold at once.
    - ``observer``: metrics (``refitflow.metrics.prometheus.PrometheusMetrics``).
    - ``receiver_id``: this rank's name at the registry (default: a random one).
    - ``layout``: this rank's layout map (e.g. ``refitflow.layouts.fused.layout(dims, parallel)``): the
      publisher's tensors are translated into it, and only this rank's slice is read.
    - ``serve_replicas``: serve each version to other receivers as a relay, tensor by tensor as soon as its
      bytes are verified, before this rank commits (pipelined fan-out; docs/fanout.md). Every receiver
      with a registry that has relays reads from the upstream relay the registry names, if any — but one
      given a ``read_start``, which reads the trainer from there (relays read in one order).
    - ``security``: CURVE for a registry given by address: the deployment's keys (``rf.DeploymentKeys``: the
      receiver presents its ``rollout`` pair) or an ``rf.ClientSecurity`` (as for ``rf.Publisher``).
    - ``quant``: parameter name -> quantised format (``layouts/quant.py``) where its dtypes cannot tell: a
      float8 parameter with its scales beside it is found by itself (docs/quant.md).
    - ``**options``: the other ``rf.ReceiverConfig`` fields (``lossy_casts``, ``verify``,
      ``read_timeout_s``, ...; each is documented there); an unknown one is a ``ConfigError``.

    ``refit`` = ``prepare`` + ``finish``; an engine-wide vote goes between the two
    (``rf.EngineMember``). ``status`` and ``fence`` say what the rank serves. ``rebind`` follows the model
    after the server replaced its parameters' storages (a refit refuses until then: ``PlanError``).
    """

    def __init__(
        self,
        model: torch.nn.Module | Mapping[str, torch.Tensor],
        registry: Discovery | str,
        *,
        identity: Identity,
        transport: str | Transport = "auto",
        mode: str = "in_place",
        budget_bytes: int = ReceiverConfig.budget_bytes,
        observer: Observer = NULL_OBSERVER,
        receiver_id: str | None = None,
        layout: Mapping[str, LocalTensor] | None = None,
        serve_replicas: bool = False,
        security: ClientSecurity | DeploymentKeys | None = None,
        quant: Mapping[str, str] | None = None,
        **options: Any,
    ) -> None:
        unknown = sorted(set(options) - set(ReceiverConfig.__dataclass_fields__))
        if unknown:
            raise ConfigError(f"unknown receiver options {unknown}; see rf.ReceiverConfig")
        if not isinstance(model, torch.nn.Module | Mapping):
            raise ConfigError(
                f"model must be a torch.nn.Module or a mapping of names to tensors, got {type(model).__name__}"
                + ("; name the tensors, e.g. dict(model.named_parameters())" if isinstance(model, list | tuple) else "")
            )
        if not isinstance(identity, Identity):
            raise ConfigError(f"identity must be an rf.Identity, got {type(identity).__name__}")
        self.config = ReceiverConfig(budget_bytes=budget_bytes, mode=mode, **options)  # type: ignore[arg-type]
        transport = choose_transport(transport, registry)
        self._owns_registry = isinstance(registry, str)  # an address: a client opened and closed with us
        self.registry: Discovery = connect_registry(registry, security, "rollout")
        self.identity = identity
        self.receiver_id = receiver_id or f"receiver-{uuid.uuid4().hex[:12]}"
        self.observer = observer
        self._model, self._layout, self._quant = model, layout, quant  # made again by rebind()
        rank = RankState.build(model, self.config.mode, layout, self.config.budget_bytes, observer,
                               shadow_commit=self.config.shadow_commit, quant=quant)  # fmt: skip
        self.destination, self.fence, self.budget, self.ledger = rank.destination, rank.fence, rank.budget, rank.ledger
        self.devices: DeviceLane = rank.devices  # refit streams and events (refit/device.py)
        observer.budget(0, 0, self.config.budget_bytes)  # the capacity is known before anything is staged
        self._plans = PlanCache(on_drop=self._forget_plan)
        self._unreadable: set[int] = set()  # versions whose sources this rank could not reach: passed over
        self._transport_spec = transport
        self._transport: Transport | None = None
        self._arena: StagingArenas | None = None
        # staging: one ring per device, each an equal share of the budget; a bucket fits one share
        share = self.config.budget_bytes // len(self.devices.devices)
        if share < 64:
            raise ConfigError(f"budget_bytes {self.config.budget_bytes} leaves {share} bytes per device's staging ring "
                              f"over {len(self.devices.devices)} devices; give at least 64 per device")  # fmt: skip
        self.limits = replace(self.config.limits, bucket_bytes=min(self.config.limits.bucket_bytes, share))
        # pipelined fan-out: serve verified bytes to other receivers; read from the upstream relay named
        self.serve_replicas = serve_replicas
        if serve_replicas and self.config.verify != "strict":
            raise ConfigError("serve_replicas serves only verified bytes: it needs verify='strict'")
        if serve_replicas and self.config.read_start:
            raise ConfigError("serve_replicas reads in the relays' one order (a chain's readers follow it): "
                              f"read_start must be 0, got {self.config.read_start}")  # fmt: skip
        if serve_replicas:  # relays report progress bucket by bucket: small buckets keep the pipeline short
            cap = self.config.relay_bucket_bytes
            self.limits = replace(self.limits, bucket_bytes=min(self.limits.bucket_bytes, cap),
                                  direct_bucket_bytes=min(self.limits.direct_bucket_bytes, cap))  # fmt: skip
        self._relaying: Relaying | None = None
        self._landing: set[int] = set()  # the transport regions of the tensors reads land in
        self._running = False  # a prepare is in progress (one at a time)

    async def __aenter__(self) -> Receiver:
        try:
            # off the loop: a real transport imports its library and creates its agent (seconds)
            self._transport = await anyio.to_thread.run_sync(make_transport, self._transport_spec)
            await self._land()
            self._arena = StagingArenas(self.budget, self.devices.devices, register=self._transport.register)
            await self.registry.register_receiver(self.identity, self.receiver_id)
        except BaseException:
            await self._close()  # a failed enter leaks nothing: no transport, no registry client
            raise
        return self

    async def _land(self) -> None:
        """Bind to ``self.destination``: what plans need of it, a byte view and a registration of every
        tensor a read may land in (each on its own device, DRAM or VRAM), and a relay for it."""
        assert self._transport is not None
        await anyio.to_thread.run_sync(self._prepare_landing)
        self._landing = {self._transport.register(t) for t in self.destination.landing_tensors()}
        if not self.config.read_start:  # a rotated reader reads the trainer (docs/fanout.md)
            self._relaying = Relaying(self.registry, self.identity, self.receiver_id, self.destination,
                                      self._transport, serve=self.serve_replicas)  # fmt: skip

    async def rebind(self) -> None:
        """Follow the model's parameters as they are now, after the server replaced their storages or the
        Parameter objects themselves (``param.data = ...``, ``module.to(dtype)``, a reload): every view,
        registration, plan and relay is made again from the model, between refits. The next refit reads
        every byte (nothing is known of what the new storages hold); until it commits, ``status`` names
        the last version refitflow committed. Parameters now on other devices need a new receiver."""
        if self._transport is None or self._arena is None:
            raise ConfigError("use the receiver inside 'async with'")
        if self._running or self.ledger.open is not None:
            raise VersionError("a refit is running on this receiver: rebind between refits")
        new = Destination(self._model, self.config.mode, self._layout, shadow_commit=self.config.shadow_commit,
                          quant=self._quant)  # fmt: skip
        if new.devices != self.destination.devices:
            raise ConfigError(f"the parameters now sit on {[str(d) for d in new.devices]}, not "
                              f"{[str(d) for d in self.destination.devices]}: make a new rf.Receiver")  # fmt: skip
        if self._relaying is not None:
            await self._relaying.close()  # its offer names the old storages
        old = self._landing
        self.destination = self.ledger.destination = new
        self._plans.clear()  # every plan names the old storages: the transport lets go of their reads
        await self._land()
        for region in old - self._landing:
            self._transport.deregister(region)

    def _forget_plan(self, plan: Plan) -> None:
        """A plan the cache dropped: the transport lets go of what it prepared for its reads."""
        if self._transport is not None:
            self._transport.forget(plan.serial)

    def _prepare_landing(self) -> None:
        """The first refit's share of setup, done once as the receiver starts (a worker thread): what plans
        need of the parameters (``planner.ReceiverLayout``) and a byte view of each (reads land there). Not
        their memoryviews: 10,000 more objects the collector tracks moved a full pass (≈ 100 ms, every
        thread stopped) into the first refit of ``bench/loop_lag.py``."""
        self._plans.receiver(self.destination)
        for name in self.destination.params:
            self.destination.target_bytes(name)

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        with anyio.CancelScope(shield=True):
            try:
                await self.registry.unregister_receiver(self.identity, self.receiver_id)
            except RefitError:
                if e is None:  # never mask the body's own error (the registry's lease expires us anyway)
                    raise
            finally:
                await self._close()

    async def _close(self) -> None:
        """Close the transport and a registry client this receiver opened (shielded)."""
        with anyio.CancelScope(shield=True):
            try:
                if self._transport is not None:
                    await self._transport.aclose()
            finally:
                self._transport = None
                if self._owns_registry:
                    await self.registry.aclose()  # type: ignore[attr-defined]

    @property
    def status(self) -> ReceiverStatus:
        return ReceiverStatus.of(self.ledger)

    async def refit(self, min_version: int | None = None, *, timeout: float = 60.0) -> RefitResult:
        """Refit to the newest complete version ≥ ``min_version`` (default: newer than the last begun).

        Waits up to ``timeout`` seconds for such a version to be published. Raises ``VersionError``
        (refused, nothing changed) when that version is not newer than the last one begun here.
        """
        txn, result = await self.prepare(min_version, timeout=timeout)
        await self.finish(txn)
        return result

    async def prepare(
        self, min_version: int | None = None, *, timeout: float = 60.0
    ) -> tuple[Transaction, RefitResult]:
        """Run the pipeline to a prepared transaction: everything verified, nothing visible yet.

        Call ``finish`` (or ``abort``) next; an engine-wide vote goes between the two.
        """
        if self._transport is None or self._arena is None:
            raise ConfigError("use the receiver inside 'async with'")
        if self._running or self.ledger.open is not None:  # refused before touching anything the running one uses
            txn = self.ledger.open
            still = f" (version {txn.version} is still open: {txn.state.value})" if txn is not None else ""
            raise VersionError(f"a refit is already running on this receiver{still}",
                               version=None if txn is None else txn.version)  # fmt: skip
        self._running = True
        try:
            return await self._prepare(min_version, timeout)
        finally:
            self._running = False

    async def _prepare(self, min_version: int | None, timeout: float) -> tuple[Transaction, RefitResult]:
        assert self._transport is not None and self._arena is not None  # entered (prepare checked)
        if min_version is None:
            min_version = (self.ledger.last_begun or 0) + 1
        res = Resources(
            destination=self.destination, staging=self._arena, devices=self.devices, ledger=self.ledger,
            limits=self.limits, plans=self._plans, transport=self._transport, fanout=self._relaying,
            observer=self.observer, unreadable=self._unreadable, window=self.config.window_buckets or 4,
        )  # fmt: skip
        misses = self._plans.misses
        self.budget.reset_peak()
        d = self.destination
        if self._relaying is not None and d.holdings.ids(d.generation)[0] == d.holdings.ids(d.generation + 1)[0]:
            await self._relaying.leave()  # this refit overwrites the storage served: offer it to nobody new
        before = self.ledger.last_begun  # a failure after begin reports the version it consumed
        try:
            # a storage replaced behind our back (param.data = ...): refused before anything is written
            await off_loop(d.check_unmoved) if len(d.params) > 1024 else d.check_unmoved()
            with anyio.fail_after(self.config.refit_timeout_s):
                outcome = await run_pipeline(
                    res, registry=self.registry, identity=self.identity, min_version=min_version,
                    discover_timeout=timeout, depth=self.config.stream_depth,
                )  # fmt: skip
        except BaseException as exc:
            began = self.ledger.last_begun if self.ledger.last_begun != before else None
            await self._ended(began, exc)
            if isinstance(exc, IntegrityError) and RELEASED_HINT not in str(exc):
                raise IntegrityError(f"{exc.reason}; {RELEASED_HINT}", version=exc.version, tensor=exc.tensor) from exc
            if isinstance(exc, TimeoutError) and not isinstance(exc, RefitError):
                raise RefitTimeoutError(
                    f"refit did not finish within {self.config.refit_timeout_s} s",
                    version=began,
                ) from exc
            raise
        result = refit_result(
            outcome, seconds=time.perf_counter() - outcome.attempt.found.found_at,
            plan_cached=self._plans.misses == misses, peak_staging_bytes=self.budget.statistics().peak_bytes,
        )  # fmt: skip
        for kind, n in (("skipped", result.skipped_bytes), ("rechecked", result.rechecked_bytes),
                        ("repaired", result.repaired_bytes), ("relayed", result.relay_bytes),
                        ("rerouted", result.rerouted_bytes)):  # fmt: skip
            self.observer.refit_bytes(kind, n)
        return outcome.txn, result

    async def finish(self, txn: Transaction) -> None:
        """Make a prepared version visible."""
        if self.destination.copies_at_commit:
            await self._copy_in(txn)
        self.ledger.finish(txn)
        self.observer.refit_outcome("committed", txn.version)
        await self._report(txn.version)

    async def _copy_in(self, txn: Transaction) -> None:
        """``shadow_commit="copy"``: copy the shadows into the live storage on the refit streams, fence closed.

        The stall is the device copy (waited for off the event loop); a failure or cancellation while
        it runs leaves the rank fenced.
        """
        self.ledger.copying(txn)
        devices = self.devices

        def copy() -> Marks:
            with devices.use(devices.devices):
                self.destination.copy_in()
                return devices.record(devices.devices)

        try:
            await devices.quiesce()  # kernels the server queued before the fence closed read the live storage
            await devices.wait(await anyio.to_thread.run_sync(copy))
        except BaseException as exc:
            with anyio.CancelScope(shield=True):
                await self.abort(txn, f"copy into the live parameters failed: {type(exc).__name__}: {exc}")
            raise

    async def abort(self, txn: Transaction, reason: str) -> None:
        """Abandon a prepared version (e.g. a peer of the engine was not ready)."""
        self.ledger.abort(txn, reason)
        self.observer.refit_outcome("aborted", txn.version)
        await self._report(txn.version)

    async def _report(self, version: int) -> None:
        """Tell the registry this rank is done with ``version`` (shielded, bounded)."""
        with anyio.CancelScope(shield=True), anyio.move_on_after(5):
            await self.registry.report(self.identity, self.receiver_id, version)

    async def _ended(self, version: int | None, exc: BaseException) -> None:
        refused = isinstance(exc, RefitError) and version is None  # never began: nothing consumed
        if self._relaying is not None and version is not None:
            self._relaying.abandon()
            await self._relaying.leave()
        self.observer.refit_outcome("refused" if refused else "aborted", version)
        if version is not None:
            await self._report(version)
