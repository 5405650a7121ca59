"""One inference rank's refitflow side, behind synchronous calls: update (pull, verify, vote), commit.

An engine's worker (vLLM, SGLang) calls ``update`` and ``commit`` from its own thread; the session
runs them on its ``LoopThread`` under deadlines. ``update`` prepares the version on this rank and
runs the engine vote at once, so every rank leaves ``update`` agreeing: all prepared (then
``commit`` makes the version visible, and cannot fail), or all aborted — in place fenced, shadow
still serving the previous version — and every rank raises. Two writers:

- ``direct``: a ``Receiver`` writing the live parameters (or their shadows) through the layout
  derived from the model (``fused_model.derive``): only this rank's slices are read.
- ``load_weights``: the publication's whole tensors, HF-named, fed through the model's own
  ``load_weights`` in budget-sized buckets (``load_weights.BucketLoader``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from refitflow.api.receiver import Receiver, RefitResult
from refitflow.core.errors import ConfigError, RefitError
from refitflow.core.types import Identity
from refitflow.engine.member import EngineMember, EngineOutcome
from refitflow.engine.vote import Ballot, Decision, GlooVote, VoteChannel
from refitflow.engine.zmq_vote import ZmqVote
from refitflow.integrations.fused_model import Derived
from refitflow.integrations.loop_thread import LoopThread

__all__ = ["Alone", "RankSession", "SessionConfig", "Writer", "direct_writer"]

log = logging.getLogger(__name__)


class Alone:
    """The vote of an engine of one rank."""

    rank, size = 0, 1

    async def exchange(self, ballot: Ballot, timeout: float) -> list[Ballot | None]:
        return [ballot]


@dataclass(frozen=True, kw_only=True)
class SessionConfig:
    registry: str
    identity: Identity
    receiver_id: str
    mode: str = "in_place"
    budget_bytes: int = 256 << 20
    transport: str = "nixl"
    vote: str = "none"  # none, zmq, gloo
    vote_rank: int = 0
    vote_addresses: tuple[str, ...] = ()
    vote_timeout_s: float = 30.0
    init_timeout_s: float = 120.0
    receiver_options: Mapping[str, Any] = field(default_factory=dict)


class Writer(Protocol):
    """How a session's version reaches the model: prepare + vote, then commit (or abort)."""

    async def prepare(self, version: int, *, wait_s: float) -> EngineOutcome: ...
    async def commit(self, outcome: EngineOutcome) -> None: ...
    async def abort(self, outcome: EngineOutcome, reason: str) -> None: ...
    @property
    def status(self) -> dict[str, Any]: ...


class _Direct:
    def __init__(self, member: EngineMember) -> None:
        self.member = member

    async def prepare(self, version: int, *, wait_s: float) -> EngineOutcome:
        return await self.member.prepare(version, timeout=wait_s)

    async def commit(self, outcome: EngineOutcome) -> None:
        await self.member.commit(outcome)

    async def abort(self, outcome: EngineOutcome, reason: str) -> None:
        await self.member.abort(outcome, reason)

    @property
    def status(self) -> dict[str, Any]:
        s = self.member.receiver.status
        return {"committed_version": s.committed_version, "fence": s.fence, "first_failure": s.first_failure}


def _vote_channel(config: SessionConfig, gloo_group: Any) -> VoteChannel:
    if config.vote == "none":
        return Alone()
    if config.vote == "zmq":
        return ZmqVote(config.vote_rank, list(config.vote_addresses), group=f"{config.identity.model}-engine")
    if config.vote == "gloo":
        return GlooVote(gloo_group)
    raise ConfigError(f"unknown engine vote {config.vote!r}")


class RankSession:
    """Opened once per trainer connection (``open`` with ``direct_writer`` or ``load_weights_writer``)."""

    def __init__(self, config: SessionConfig, loop: LoopThread) -> None:
        self.config = config
        self.loop = loop
        self._stack = contextlib.AsyncExitStack()
        self.writer: Writer | None = None
        self.pending: EngineOutcome | None = None  # voted to commit, waiting for ``commit``
        self.last_result: RefitResult | None = None

    @classmethod
    def open(
        cls,
        config: SessionConfig,
        build: Callable[[SessionConfig, VoteChannel, contextlib.AsyncExitStack], Any],
        *,
        gloo_group: Any = None,
    ) -> RankSession:
        """Start the loop thread and, on it, the writer ``build`` makes (its receivers, the vote channel)."""
        session = cls(config, LoopThread(f"refitflow-{config.receiver_id}"))

        async def start() -> None:
            channel = _vote_channel(config, gloo_group)  # made on the loop: its sockets belong to it
            if isinstance(channel, ZmqVote):
                session._stack.callback(channel.close)
            session.writer = await build(config, channel, session._stack)

        try:
            session.loop.run(start, timeout=config.init_timeout_s, what="opening the refitflow receiver")
        except BaseException:
            session.close()
            raise
        return session

    def update(self, version: int, *, timeout_s: float, wait_s: float) -> RefitResult | None:
        """Pull, verify and prepare ``version`` (or newer) and vote; raise unless every rank is ready."""
        if self.pending is not None:
            raise ConfigError(f"version {self.pending.version} is prepared and not yet committed: finish it first")
        assert self.writer is not None
        writer = self.writer
        outcome = self.loop.run(writer.prepare, version, wait_s=wait_s, timeout=timeout_s, what="the refitflow update")
        if outcome.decision is not Decision.COMMIT:
            message = f"version {version} not committed (engine vote: {outcome.decision.value}; {writer.status})"
            if isinstance(outcome.error, RefitError):  # this rank's own failure, typed, with the vote noted
                outcome.error.add_note(message)
                raise outcome.error
            raise RefitError(f"{message}: a peer was not ready", version=version)
        self.pending = outcome
        self.last_result = outcome.result
        return outcome.result

    def commit(self) -> int | None:
        """Make the prepared version visible on this rank; the version committed (None: nothing pending)."""
        outcome, self.pending = self.pending, None
        if outcome is None:
            return None
        assert self.writer is not None
        self.loop.run(self.writer.commit, outcome, timeout=self.config.vote_timeout_s, what="the refitflow commit")
        return outcome.version

    def drop_pending(self, reason: str) -> None:
        """Abort a version voted to commit that the host never finished (a new update started)."""
        outcome, self.pending = self.pending, None
        if outcome is not None and self.writer is not None:
            log.warning("aborting prepared version %s: %s", outcome.version, reason)
            self.loop.run(self.writer.abort, outcome, reason, timeout=self.config.vote_timeout_s)

    @property
    def status(self) -> dict[str, Any]:
        return self.writer.status if self.writer is not None else {}

    def close(self) -> None:
        try:
            with contextlib.suppress(RefitError):  # closing is best effort: the registry's lease expires us anyway
                self.loop.run(self._stack.aclose, timeout=self.config.init_timeout_s, what="closing refitflow")
        finally:
            self.loop.close()


def direct_writer(targets: Derived) -> Callable[..., Any]:
    """``build`` for ``RankSession.open``: a ``Receiver`` writing ``targets`` through their derived layout."""

    async def build(config: SessionConfig, channel: VoteChannel, stack: contextlib.AsyncExitStack) -> Writer:
        options = dict(config.receiver_options)
        if config.mode == "shadow":  # commit by copy: the engine's pointers (CUDA graphs) stay
            options.setdefault("shadow_commit", "copy")
        receiver = Receiver(
            targets.targets, config.registry, identity=config.identity, transport=config.transport, mode=config.mode,
            budget_bytes=config.budget_bytes, receiver_id=config.receiver_id, layout=targets.layout, **options,
        )  # fmt: skip
        await stack.enter_async_context(receiver)
        return _Direct(EngineMember(receiver, channel, vote_timeout=config.vote_timeout_s))

    return build
