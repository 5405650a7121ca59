"""One refit attempt as the stages see it: the rank's resources, the attempt value, and what each stage counts.

- ``Resources``: what every attempt of one rank writes into and reads through — destination, staging arena,
  device lane, ledger, plan cache, transport, fan-out — concretely typed, fixed across attempts.
- ``Found`` (made by discover): the publication and the transaction begun for it.
- ``Attempt`` (made by the plan stage from ``Found``): adds the plan and its replay state, the version's
  digests, the delta decision and the upstream relay. It is handed to every stage with the buckets; nothing
  in it is written after it is made but the upstream's health (``Upstream.fail``) and ``Placing`` (the check
  of a whole publication's shards, run beside the reads, done).
- ``Meter``: one stage's row of the result's table (items, bytes, busy seconds), written by that stage alone.
- ``Tally``: what commit adds up from the buckets it credits (bytes pulled, relayed, rerouted, repaired,
  unverified): with the meters and the attempt it makes the ``RefitResult``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import anyio
import numpy as np

from refitflow.core.types import Publication
from refitflow.metrics import NULL_OBSERVER, Observer
from refitflow.planner.delta import Skips
from refitflow.planner.limits import Limits
from refitflow.planner.records import Plan
from refitflow.refit.arena import StagingArenas
from refitflow.refit.destination import Destination
from refitflow.refit.device import DeviceLane
from refitflow.refit.fanout.relaying import Relaying, Upstream
from refitflow.refit.plans import PlanCache, Replay
from refitflow.refit.transaction import Ledger, Transaction
from refitflow.transports.base import Transport

__all__ = ["STAGES", "Attempt", "Found", "Meter", "Placing", "Resources", "Tally"]

STAGES = ("discover", "plan", "allocate", "pull", "translate", "apply", "verify", "commit")


@dataclass(frozen=True, kw_only=True, eq=False)
class Resources:
    """What the stages of every attempt of one rank write into and read through."""

    destination: Destination
    staging: StagingArenas
    devices: DeviceLane
    ledger: Ledger
    limits: Limits
    plans: PlanCache
    transport: Transport | None = None  # None: bytes arrive another way (a push stream), not by reads
    fanout: Relaying | None = None  # pipelined fan-out (None: this rank neither relays nor reads relays)
    observer: Observer = NULL_OBSERVER
    unreadable: set[int] = field(default_factory=set)  # versions whose sources this rank cannot reach (discover)
    window: int = 4  # buckets in flight in the pull stage (ReceiverConfig.window_buckets)


@dataclass(frozen=True, kw_only=True, eq=False)
class Found:
    """What discover found and began."""

    publication: Publication  # pending (announced before its digests): ``complete`` fetches them
    txn: Transaction
    waited_s: float  # how long discovery waited for it
    found_at: float  # perf_counter when it was found
    complete: Callable[[], Awaitable[Publication]] | None = None  # pending: the same version with its digests


class Placing:
    """A whole publication's shards are checked against where the plan's layout put them beside the first
    reads (``planner.vector.check_placed``: ≈ 2 ms for 10,000 shards), not before them (``stages.plan.check_placed``);
    where nothing before the reads needs the version's digests (no delta decision, no relay joined), the digests
    themselves are taken there too (``vec``: gathered from a whole publication's manifests, or a round trip to a
    registry for the plan's part). Nothing is compared (verify) or prepared (commit) before it passed; when it
    fails, the attempt fails with its ``ManifestError``. A delta decision taken from unchecked digests may skip or
    pull the wrong pieces, which is harmless: the attempt fails before anything is compared."""

    def __init__(self, *, check: bool) -> None:
        self.check = check  # the shards' places are checked here (a whole publication's, not a registry's)
        self.vec: np.ndarray | None = None  # the digests, when they are taken here (``Attempt.digests`` None)
        self.done = anyio.Event()


@dataclass(frozen=True, kw_only=True, eq=False)
class Attempt:
    """One refit attempt: the publication, its transaction and plan, and what this version decides of them."""

    found: Found
    plan: Plan
    replay: Replay  # what refits made of the plan (plans.py): reads, copies, views
    digests: np.ndarray | None  # the version's digest vector (None: taken beside the reads, or announced later)
    skips: Skips | None = None  # the delta decision (None: every piece is pulled)
    upstream: Upstream | None = None  # the relay this attempt reads from, if any
    placing: Placing | None = None  # what is checked (and taken) beside the first reads

    async def placed(self) -> None:
        """Return once the digests' shards are known to be where the plan's layout put them (``Placing``)."""
        if self.placing is not None and not self.placing.done.is_set():
            await self.placing.done.wait()

    @property
    def publication(self) -> Publication:
        return self.found.publication

    @property
    def txn(self) -> Transaction:
        return self.found.txn

    @property
    def version(self) -> int:
        return self.found.txn.version


class Meter:
    """One stage's work: items and bytes it passed on and its busy seconds, told to the observer as it goes."""

    def __init__(self, stage: str, observer: Observer) -> None:
        self.stage, self.observer = stage, observer
        self.items = self.nbytes = 0
        self.seconds = 0.0
        self.noted = False  # any work accounted (a stage that never ran has no row in the result)

    def enter(self) -> None:
        self.observer.stage_enter(self.stage)

    def note(self, items: int, nbytes: int, seconds: float, *, item: bool = True) -> None:
        """Account work (``item``: one item left the stage, tell the observer)."""
        self.noted = True
        self.items += items
        self.nbytes += nbytes
        self.seconds += seconds
        if item:
            self.observer.stage_item(self.stage, nbytes, seconds)


@dataclass
class Tally:
    """Bytes of one refit by how they arrived, added up by commit from the buckets it credits."""

    pulled: int = 0  # read from a source (trainer or relay), re-reads included
    relayed: int = 0  # of ``pulled``, read from an upstream relay
    rerouted: int = 0  # of ``pulled``, read from the trainer after a relay failed, stalled or sent bad bytes
    repaired: int = 0  # of the skipped pieces re-hashed, those that differed and were read again
    unverified: int = 0  # pulled bytes no whole digest block covered
