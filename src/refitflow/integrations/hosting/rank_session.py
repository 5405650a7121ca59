"""One inference rank's refitflow side, behind synchronous calls: update (pull, verify, vote), commit.

An engine's worker (vLLM, SGLang) calls ``update`` and ``commit`` from its own thread; the session
runs them on its ``LoopThread`` under deadlines. Every writer is an ``EngineMember`` around a
``Preparer``, voting through the engine's channel (``SoloVote`` for one rank, ``ZmqVote``,
``GlooVote``): ``update`` prepares the version on this rank and votes at once, so every rank leaves
``update`` knowing the engine's verdict — COMMIT (the version waits, invisible, for ``commit``),
ABORT (in place fenced, shadow still serving the previous version; ``update`` raises) — or, having
voted ready and lost touch with the vote, in doubt: ``update`` asks the peers for the verdict once
(``EngineMember.resolve``, its ``resolve_timeout``) and goes on with what it learns; still in doubt, it
raises saying so, and the next ``update`` learns the verdict first. Two preparers:

- ``direct``: a ``Receiver`` writing the live parameters (or their shadows, copied in at commit)
  through the layout derived from the model (``fused_model.derive``): only this rank's slices are read.
- ``load_weights``: the publication's whole tensors, HF-named, fed through the model's own
  ``load_weights`` in budget-sized buckets (``load_weights.BucketLoader``).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import socket
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import anyio

from refitflow.api.receiver import Receiver, RefitResult
from refitflow.core.errors import ConfigError, RefitError
from refitflow.core.types import Identity
from refitflow.engine.gloo_vote import GlooVote
from refitflow.engine.member import EngineMember, EngineOutcome, Preparer
from refitflow.engine.solo_vote import SoloVote
from refitflow.engine.vote import Decision, VoteChannel
from refitflow.engine.zmq_vote import ZmqVote
from refitflow.integrations.hosting.fused_model import Derived
from refitflow.integrations.hosting.loop_thread import LoopThread
from refitflow.registry.keys import DeploymentKeys, client_of, server_of
from refitflow.registry.security import ClientSecurity

__all__ = ["Build", "RankSession", "SessionConfig", "direct_writer", "process_id"]

log = logging.getLogger(__name__)

MODES = ("in_place", "shadow")
VOTES = ("none", "zmq", "gloo")
# receiver options the session sets itself (a shadow commits by copy: the engine's CUDA graphs hold pointers)
_OWN = ("mode", "shadow_commit", "layout", "budget_bytes", "transport", "receiver_id", "identity")


@dataclass(frozen=True, kw_only=True)
class SessionConfig:
    registry: str
    identity: Identity
    receiver_id: str
    mode: str = "in_place"
    shadow_commit: str = "copy"  # shadow: copy into the live storage (CUDA-graph safe) or swap storages (eager)
    budget_bytes: int = 256 << 20
    transport: str = "auto"  # nixl beside a registry address (api.transport.choose_transport)
    vote: str = "none"  # none (one rank), zmq, gloo
    vote_rank: int = 0
    vote_addresses: tuple[str, ...] = ()
    vote_timeout_s: float = 30.0
    init_timeout_s: float = 120.0
    receiver_options: Mapping[str, Any] = field(default_factory=dict)
    keys: DeploymentKeys | None = None  # CURVE for the registry client and the vote (None: open, said out loud)

    @property
    def security(self) -> ClientSecurity | None:
        """The registry client's CURVE keys."""
        return client_of(self.keys, "rollout")  # an inference rank

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.vote not in VOTES:
            raise ConfigError(f"the engine vote must be one of {VOTES}, got {self.vote!r}")
        if self.shadow_commit not in ("copy", "swap"):
            raise ConfigError(f"shadow_commit must be 'copy' or 'swap', got {self.shadow_commit!r}")
        own = sorted(set(self.receiver_options) & set(_OWN))
        if own:
            raise ConfigError(f"receiver_options may not set {own}: the session sets them (shadow commits by copy)")


def process_id(engine: str, model: str, place: str) -> str:
    """A rank's receiver id, unique in a fleet: the servers of one model share their places (every server has
    a ``dp0-rank0``), so the host and process tell them apart — and a restarted rank is a new receiver."""
    return f"{engine}-{model}-{place}@{socket.gethostname()}:{os.getpid()}"


# ``build`` for ``RankSession.open``: makes this rank's preparer (its resources on ``stack``)
Build = Callable[[SessionConfig, contextlib.AsyncExitStack], Awaitable[Preparer]]


def _vote_channel(config: SessionConfig, gloo_group: Any) -> VoteChannel:
    if config.vote == "zmq":
        return ZmqVote(config.vote_rank, list(config.vote_addresses), group=f"{config.identity.model}-engine",
                       server_security=server_of(config.keys), client_security=config.security,
                       insecure=config.keys is None)  # fmt: skip
    if config.vote == "gloo":
        return GlooVote(gloo_group)
    return SoloVote()


class RankSession:
    """Opened once per trainer connection (``open`` with ``direct_writer`` or ``load_weights_writer``)."""

    def __init__(self, config: SessionConfig, loop: LoopThread) -> None:
        self.config = config
        self.loop = loop
        self._stack = contextlib.AsyncExitStack()
        self.member: EngineMember | None = None
        self.pending: EngineOutcome | None = None  # voted to commit, waiting for ``commit``
        self.last_result: RefitResult | None = None
        self._background: tuple[int, concurrent.futures.Future[EngineOutcome]] | None = None  # begin_update
        self._state: tuple[str, str | None] = ("idle", None)  # poll_update

    @classmethod
    def open(cls, config: SessionConfig, build: Build, *, gloo_group: Any = None) -> RankSession:
        """Start the loop thread and, on it, the preparer ``build`` makes and the vote channel."""
        session = cls(config, LoopThread(f"refitflow-{config.receiver_id}"))

        async def start() -> None:
            channel = _vote_channel(config, gloo_group)  # made on the loop: its sockets belong to it
            if isinstance(channel, ZmqVote):
                session._stack.callback(channel.close)
            preparer = await build(config, session._stack)
            session.member = EngineMember(preparer, channel, vote_timeout=config.vote_timeout_s)

        try:
            session.loop.run(start, timeout=config.init_timeout_s, what="opening the refitflow receiver")
        except BaseException:
            session.close()
            raise
        return session

    def update(self, version: int, *, timeout_s: float, wait_s: float) -> RefitResult | None:
        """Pull, verify and prepare ``version`` (or newer) and vote; raise unless the engine decided COMMIT."""
        self._check_idle()
        outcome = self.loop.run(self._prepared, version, wait_s, timeout=timeout_s, what="the refitflow update")
        return self._settle(outcome, version)

    def catch_up_version(self, *, wait_s: float) -> int:
        """The version a rank joining a running fleet refits: the newest its peers relay, waiting up to ``wait_s``
        for them to relay the newest one held (a fleet about to refit it); 0 (the newest, from the trainer)
        when no peer relays anything or the registry cannot say."""
        return int(self.loop.run(self._peers_version, wait_s, timeout=wait_s + 30.0, what="asking what peers hold"))

    async def _peers_version(self, wait_s: float) -> int:
        registry, identity = getattr(self._member().receiver, "registry", None), self.config.identity
        relayed, versions = getattr(registry, "relayed", None), getattr(registry, "versions", None)
        if relayed is None or versions is None:
            return 0
        with anyio.move_on_after(wait_s):
            while True:
                held, newest = await relayed(identity), max(await versions(identity), default=None)
                if held is None or newest is None or held >= newest:
                    break
                await anyio.sleep(0.2)
        held = await relayed(identity)
        return 0 if held is None else int(held)

    def begin_update(self, version: int, *, timeout_s: float, wait_s: float) -> None:
        """``update`` in the background (it returns at once): ``poll_update`` says how it went."""
        self._check_idle()
        self._state = ("preparing", None)
        future = self.loop.start(self._prepared, version, wait_s, timeout=timeout_s, what="the refitflow update")
        self._background = (version, future)

    def poll_update(self) -> tuple[str, str | None]:
        """How the update is going: ``("idle" | "preparing" | "prepared" | "failed", error or None)``; a
        background update that ended is settled here (prepared: it waits for ``commit``)."""
        if self._background is not None and self._background[1].done():
            (version, future), self._background = self._background, None
            try:
                self._settle(future.result(), version)
                self._state = ("prepared", None)
            except Exception as exc:
                self._state = ("failed", f"{type(exc).__name__}: {exc}")
        return self._state

    def _check_idle(self) -> None:
        if self._background is not None:
            raise ConfigError("an update is being prepared in the background: wait for it to end first")
        if self.pending is not None:
            raise ConfigError(f"version {self.pending.version} is prepared and not yet committed: finish it first")

    async def _prepared(self, version: int, wait_s: float) -> EngineOutcome:
        member = self._member()
        outcome = await member.prepare(version, timeout=wait_s)
        if outcome.decision is Decision.IN_DOUBT:  # ask the peers once before failing: a lost verdict, usually
            with anyio.move_on_after(member.resolve_timeout + 5.0):
                learned = await member.resolve(defer=True)
                outcome = learned if learned is not None else outcome
        return outcome

    def _settle(self, outcome: EngineOutcome, version: int) -> RefitResult | None:
        if outcome.transaction is None and outcome.committed:  # it already serves the newest version ≥ asked
            self.pending = None  # (a joiner caught up ahead of its fleet's refit): nothing to commit, not a failure
            return None
        if outcome.transaction is None:
            raise self._failure(outcome, version)
        self.pending = outcome
        self.last_result = outcome.result
        return outcome.result

    def _failure(self, outcome: EngineOutcome, version: int) -> RefitError:
        if outcome.decision is Decision.IN_DOUBT:
            return RefitError(
                f"in doubt: version {outcome.version} is prepared on this rank, which voted ready in engine vote "
                f"attempt {outcome.attempt} and could not learn the verdict ({outcome.reason}); the version is not "
                "visible and the fence is 'updating'. The next update asks the peers first: a COMMIT is then made "
                "visible; if nobody can tell, the version is abandoned and this rank stays fenced until a newer "
                "version commits",
                version=outcome.version,
            )  # fmt: skip
        vote = outcome.reason or outcome.decision.value
        message = f"version {version} not committed (engine vote: {vote}; {self.status})"
        if isinstance(outcome.error, RefitError):  # this rank's own failure, typed, with the vote noted
            outcome.error.add_note(message)
            return outcome.error
        return RefitError(f"{message}: a peer was not ready", version=version)

    def commit(self) -> int | None:
        """Make the prepared version visible on this rank; the version committed (None: nothing pending)."""
        if self.poll_update()[0] == "preparing":
            raise ConfigError("the update is still being prepared: commit once it is prepared (poll_update)")
        self._state = ("idle", None)
        outcome, self.pending = self.pending, None
        if outcome is None:
            return None
        done = self.loop.run(self._member().commit, outcome, timeout=self.config.vote_timeout_s,
                             what="the refitflow commit")  # fmt: skip
        return done.version

    def drop_pending(self, reason: str) -> None:
        """Abandon a version voted to commit that the host never finished: this rank stays fenced (its
        peers may serve that version)."""
        outcome, self.pending = self.pending, None
        if outcome is not None:
            log.warning("abandoning prepared version %s: %s", outcome.version, reason)
            self.loop.run(self._member().abort, outcome, reason, timeout=self.config.vote_timeout_s)

    def fence(self, reason: str) -> None:
        """Close this rank's fence: the host found the committed version unusable (it stays fenced until a
        later version commits)."""
        ledger = self._member().receiver.ledger

        async def close() -> None:
            ledger.fence_for_peers(reason)

        self.loop.run(close, timeout=self.config.vote_timeout_s, what="fencing the rank")

    @property
    def status(self) -> dict[str, Any]:
        """Committed version, fence, first failure since the last commit, the attempt this rank is in doubt about."""
        if self.member is None:
            return {}
        ledger = self.member.receiver.ledger
        return {"committed_version": ledger.committed_version, "fence": ledger.fence.state.value,
                "fence_reason": ledger.fence.reason, "first_failure": ledger.first_failure,
                "in_doubt": self.member.in_doubt, **_pulled(self.last_result)}  # fmt: skip

    def _member(self) -> EngineMember:
        if self.member is None:
            raise ConfigError("the refitflow session did not open")
        return self.member

    def close(self) -> None:
        try:
            with contextlib.suppress(RefitError):  # closing is best effort: the registry's lease expires us anyway
                self.loop.run(self._stack.aclose, timeout=self.config.init_timeout_s, what="closing refitflow")
        finally:
            self.loop.close()


def _pulled(result: RefitResult | None) -> dict[str, int]:
    """What the last refit read: in all, of that from peers (relays) — the rest from the trainer — and from the
    trainer after a peer failed or stalled."""
    if result is None:
        return {"pulled_bytes": 0, "relay_bytes": 0, "rerouted_bytes": 0}
    return {"pulled_bytes": result.nbytes, "relay_bytes": result.relay_bytes, "rerouted_bytes": result.rerouted_bytes}


def direct_writer(derived: Derived) -> Build:
    """``build`` for ``RankSession.open``: a ``Receiver`` writing the derived targets through their layout."""

    async def build(config: SessionConfig, stack: contextlib.AsyncExitStack) -> Preparer:
        options: dict[str, Any] = dict(config.receiver_options)
        if config.mode == "shadow":  # copy (every pointer stays: CUDA graphs) or swap (eager engines: ≈ µs)
            options["shadow_commit"] = config.shadow_commit
        receiver = Receiver(
            derived.targets, config.registry, identity=config.identity, transport=config.transport,
            mode=config.mode, budget_bytes=config.budget_bytes, receiver_id=config.receiver_id,
            layout=derived.layout, security=config.security, **options,
        )  # fmt: skip
        await stack.enter_async_context(receiver)
        return receiver

    return build
