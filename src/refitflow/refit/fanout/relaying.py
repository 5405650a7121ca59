"""A rank's part in pipelined fan-out: the relay it serves as (``Relaying``), and the upstream it reads from
(``Upstream``, bound by ``Relaying.join``; read by ``fanout.reading``).

As a relay (``serve=True``) a rank keeps one status array per storage a version can land in (int64,
registered with its transport, ``core/fanout.py``): at ``begin`` — before any byte of version v lands —
the target storage's ``status[0]`` becomes v, and as buckets are verified (``verified``) each tensor
whose every element is verified gets ``status[1 + p] = v``. Bytes a reader takes are therefore verified
bytes of the version it reads, and a storage about to change says so first: in place the one storage
moves to v + 1 at the next begin; in shadow mode a version's storage changes only two versions later.

With a plan in hand (``join``) the rank joins the version's relays at the registry — with its offer
when it serves, else as a plain reader — and binds the upstream the registry names (the attempt's
``upstream``, read by the pull stage through ``fanout.reading``). The registry's answer is bounded; without
one the rank reads the trainer.
"""

from __future__ import annotations

import logging

import anyio
import anyio.to_thread
import numpy as np
import torch

from refitflow.core.dtypes import dtype_name
from refitflow.core.errors import RefitError
from refitflow.core.fanout import HeldBox, RelayOffer, RelayParam
from refitflow.core.threads import off_loop
from refitflow.core.types import Identity
from refitflow.planner.checks import Credits
from refitflow.planner.fanout import Geometry, Held, geometry, held_boxes
from refitflow.planner.records import Plan
from refitflow.refit.destination import Destination
from refitflow.registry.protocol import RelayRegistry
from refitflow.transports.base import Read, Transport

__all__ = ["Relaying", "Upstream"]

log = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 5.0


class Relaying:
    def __init__(
        self,
        registry: RelayRegistry,
        identity: Identity,
        receiver_id: str,
        destination: Destination,
        transport: Transport,
        *,
        serve: bool,
    ) -> None:
        self.registry, self.identity, self.receiver_id = registry, identity, receiver_id
        self.destination, self.transport, self.serve = destination, transport, serve
        names = list(destination.params)
        self._expected = np.array([destination.expected[n] for n in names], dtype=np.int64)
        self._counts = np.zeros(len(names), dtype=np.int64)
        targets = {destination.holdings.ids(g)[0] for g in (0, 1)}
        self.status: dict[int, torch.Tensor] = {}
        for storage in sorted(targets) if serve else ():
            self.status[storage] = torch.full((1 + len(names),), -1, dtype=torch.int64)
            transport.register(self.status[storage])
        self._params: dict[int, tuple[RelayParam, ...]] = {}
        self._flags: np.ndarray | None = None
        self._version = -1
        self._probe: torch.Tensor | None = None
        self._probe_for(1 + len(names))  # registered up front: an upstream of this layout needs no other
        self.joined = False

    def _target(self) -> int:
        return self.destination.holdings.ids(self.destination.generation)[0]

    def begin(self, version: int) -> None:
        """Version ``version`` is about to land in the target storage: say so before any byte does."""
        if not self.serve:
            return
        status = self.status[self._target()].numpy()
        status[0] = version
        self._flags, self._version = status[1:], version
        self._counts[:] = 0
        self._flags[self._expected == 0] = version  # nothing to wait for

    def abandon(self) -> None:
        """The attempt failed before it was prepared: readers waiting on what it has not verified read the
        trainer at once (what it verified stays correct, but nobody should wait for the rest)."""
        if self._flags is not None:
            self.status[self._target()].numpy()[0] = -1
            self._flags = None

    def verified(self, credits: Credits) -> None:
        """A verified bucket's elements per tensor (``planner.checks.Credits``): mark the tensors it completes."""
        if self._flags is None:
            return
        np.add.at(self._counts, credits.idx, credits.counts)
        touched = np.unique(credits.idx)
        self._flags[touched[self._counts[touched] >= self._expected[touched]]] = self._version

    def _kept(self) -> int | None:
        """The version this relay still serves while it refits the next: a shadow relay that swaps storages keeps
        the one it holds in the storage this refit leaves alone (written again only by the refit after) — its
        status says which, or none (-1: that attempt failed). None in place or with copy commits: one storage."""
        others = [s for s in self.status if s != self._target()]
        held = int(self.status[others[0]][0]) if others else -1
        return held if held >= 0 else None

    def _offer(self, version: int, held: tuple[HeldBox, ...], layout: str) -> RelayOffer:
        target = self._target()
        params = self._params.get(target)
        if params is None:  # the target storage's regions (registered up front: register is idempotent)
            d = self.destination
            params = self._params[target] = tuple(
                RelayParam(n, dtype_name(t.dtype), tuple(t.shape), self.transport.register(d.target(n)))
                for n, t in d.params.items()
            )
        return RelayOffer(
            identity=self.identity, version=version, receiver=self.receiver_id,
            source=self.transport.address(), status=self.transport.register(self.status[target]), params=params,
            held=held, layout=layout,
        )  # fmt: skip

    async def join(self, plan: Plan, version: int) -> Upstream | None:
        """Join ``version``'s relays (offering this rank if it serves); the upstream the registry names, if any."""
        held: Held
        if "held" in plan.derived or len(plan.copies) <= 256:
            held = held_boxes(plan)
        else:  # the first refit of a large plan: tens of ms of Python, off the event loop
            held = await off_loop(held_boxes, plan)
        boxes, layout = held
        offer = self._offer(version, boxes, layout) if self.serve else None
        up: RelayOffer | None = None
        with anyio.move_on_after(JOIN_TIMEOUT_S):
            try:
                up = await self.registry.relay_join(self.identity, version, self.receiver_id, layout=layout,
                                                    offer=offer, keep=self._kept())  # fmt: skip
                self.joined = self.joined or offer is not None
            except RefitError as exc:  # fan-out is an optimisation: read the trainer instead
                log.info("relays of version %d not joined: %s", version, exc)
        if up is None or up.source.transport != self.transport.name:
            return None
        self.transport.connect(up.source)
        # a new plan's checks are made on first use (``Bucket.built``): the geometry reads them, off the loop
        many = len(plan.buckets) > 64 or not all(b.is_built for b in plan.buckets)
        geo = await off_loop(geometry, plan, up) if many else geometry(plan, up)
        return Upstream(up, geo, self._probe_for(1 + len(up.params)))

    def _probe_for(self, n: int) -> torch.Tensor:
        """A registered int64 buffer of at least ``n`` words that a relay's status is read into."""
        if self._probe is None or self._probe.numel() < n:
            if self._probe is not None:
                self.transport.deregister(self.transport.register(self._probe))
            self._probe = torch.zeros(max(n, 64), dtype=torch.int64)
            self.transport.register(self._probe)
        return self._probe[:n]

    async def leave(self) -> None:
        """Serve no version any more (the next refit is about to change the bytes, or the rank leaves)."""
        if not self.joined:
            return
        with anyio.CancelScope(shield=True), anyio.move_on_after(JOIN_TIMEOUT_S):
            try:
                await self.registry.relay_leave(self.identity, self.receiver_id)
                self.joined = False
            except RefitError as exc:
                log.info("relays not left: %s", exc)

    async def close(self) -> None:
        """Leave, and let go of the buffers this relay registered (its status words and its probe)."""
        await self.leave()
        for t in [*self.status.values(), *([self._probe] if self._probe is not None else [])]:
            self.transport.deregister(self.transport.register(t))  # register is idempotent: its region
        self.status, self._probe = {}, None


class Upstream:
    """The relay this attempt reads from: its offer, its layout's geometry for this plan, and the probe
    (a registered int64 buffer shaped like its status) its progress is read into."""

    def __init__(self, offer: RelayOffer, geometry: Geometry, probe: torch.Tensor) -> None:
        self.offer = offer
        self.geometry = geometry
        self.probe = probe
        self.failed: str | None = None  # why it is not read from any more in this attempt
        self.status_reads: list[Read] = []  # the one read of its status
        self.pace = 0.0  # how long a wait for its next verified pieces took, averaged (0: none yet)
        probe.fill_(-1)  # nothing of this relay read yet (the buffer held another relay's status before)

    def fail(self, why: str) -> None:
        if self.failed is None:
            log.warning("relay %s (%s): %s; reading its part from the trainer", self.offer.receiver,
                        self.offer.source.agent, why)  # fmt: skip
            self.failed = why
