"""The engine vote over refitflow's own ZMQ sockets, for engines with no torch.distributed group.

Every rank binds one PULL socket on its own address and connects one PUSH socket to each peer's
(one per peer: a PUSH connected to several would round-robin). A background task (the *pump*)
reads every message and hands it to this rank's ``commitment.Node`` — rank 0's holds the
register — and sends what the node answers; it runs for the channel's whole life, so a rank
answers a peer's question (the verdict of an attempt) whether or not it is voting itself.

``vote`` sends this rank's ballot to the coordinator and says it again every ``resend_s`` until the
verdict arrives, up to ``timeout``; then it asks the coordinator to write ABORT and waits
``settle_s`` more; without an answer the rank is in doubt (``Decision.IN_DOUBT``). ``resolve`` asks
every peer until one answers. Attempt ids count votes, or are set with ``set_attempt`` by whoever
drives the attempts (the controller's command id), which keeps ranks in step even after one of them
was restarted.

Security: ``server_security`` makes the PULL socket a CURVE server that accepts only the rollout keys of
its allow-list (an engine's ranks; a trainer's or an operator's key of the same deployment cannot vote),
``client_security`` the PUSH sockets CURVE clients (one key set for a deployment,
``refitflow keys``; give both or neither). Without them use loopback or a private network only: a
process that can reach the PULL socket could vote in a rank's name.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any

import anyio
import zmq
import zmq.asyncio

from refitflow.core.errors import ConfigError
from refitflow.core.wire import encode
from refitflow.engine.commitment import Kind, Message, Node
from refitflow.engine.vote import AttemptIds, Ballot, Decision, Verdict, decode_object
from refitflow.registry.address import attach
from refitflow.registry.security import ClientSecurity, ServerSecurity, check_exposed

__all__ = ["ZmqVote", "decode_vote", "encode_vote"]

log = logging.getLogger(__name__)

MAX_FRAME = 4096  # a vote message is < 300 bytes; anything larger is not one
_DECISIONS = (Decision.COMMIT, Decision.ABORT, Decision.NOTHING)


def encode_vote(group: str, m: Message) -> bytes:
    out: dict[str, Any] = {"g": group, "k": m.kind.value, "a": m.attempt, "r": m.sender}
    if m.ballot is not None:
        out["b"] = [m.ballot.ready, m.ballot.began, m.ballot.version]
    if m.verdict is not None:
        out["d"] = [m.verdict.decision.value, m.verdict.version, m.verdict.reason[:500]]
    return encode(out)


def _int(value: Any, lo: int, hi: int) -> int:
    if type(value) is not int or not lo <= value < hi:
        raise ValueError(f"{value!r:.40} is not an integer in [{lo}, {hi})")
    return value


def decode_vote(data: bytes, *, group: str, rank: int, size: int) -> Message:
    """A peer's message to ``rank``, checked field by field; ``ValueError`` for anything else."""
    m = decode_object(data, MAX_FRAME, "vote message")
    if m.get("g") != group:
        raise ValueError(f"not a message of vote group {group!r}")
    kind = Kind(str(m.get("k")))
    attempt = _int(m.get("a"), 0, 1 << 63)
    sender = _int(m.get("r"), 0, size)
    if sender == rank:
        raise ValueError(f"a message in this rank's own name ({rank})")
    ballot = verdict = None
    if kind is Kind.BALLOT:
        b = m.get("b")
        if not (isinstance(b, list) and len(b) == 3 and all(type(x) is bool for x in b[:2])):
            raise ValueError("a ballot is [ready, began, version]")
        ballot = Ballot(b[0], b[1], _int(b[2], -1, 1 << 63))
    elif kind is Kind.DECISION:
        d = m.get("d")
        if not (isinstance(d, list) and len(d) == 3 and isinstance(d[2], str)):
            raise ValueError("a decision is [decision, version, reason]")
        decision = Decision(d[0])
        if decision not in _DECISIONS:
            raise ValueError(f"{decision} is not a verdict")
        version = None if d[1] is None else _int(d[1], -1, 1 << 63)
        if (decision is Decision.COMMIT) != (version is not None):
            raise ValueError("a COMMIT names its version, nothing else does")
        verdict = Verdict(attempt, decision, version, d[2][:500])
    return Message(kind, attempt, sender, rank, ballot=ballot, verdict=verdict)


class ZmqVote(AttemptIds):
    """``VoteChannel`` over ZMQ: ``addresses[i]`` is rank ``i``'s ``tcp://host:port`` (or ``ipc://``)."""

    def __init__(
        self,
        rank: int,
        addresses: Sequence[str],
        *,
        group: str = "engine",
        resend_s: float = 0.1,
        settle_s: float = 1.0,
        linger_s: float = 1.0,
        server_security: ServerSecurity | None = None,
        client_security: ClientSecurity | None = None,
        insecure: bool = False,
    ) -> None:
        if not 0 <= rank < len(addresses):
            raise ConfigError(f"rank {rank} is not one of the {len(addresses)} addresses of the engine")
        if len(set(addresses)) != len(addresses):
            raise ConfigError(f"every rank of an engine needs its own vote address, got {list(addresses)}")
        if (server_security is None) != (client_security is None):
            raise ConfigError("CURVE for the vote needs both server_security and client_security, or neither")
        if resend_s <= 0 or settle_s < 0:
            raise ConfigError("resend_s must be positive and settle_s not negative")
        self.rank, self.size, self.group = rank, len(addresses), group
        self.resend_s, self.settle_s, self.linger_s = resend_s, settle_s, linger_s
        self.addresses = list(addresses)
        self.node = Node(rank, self.size)
        self._context = zmq.asyncio.Context()
        self._auth = None
        try:
            if server_security is not None:
                self._auth = server_security.authenticator(self._context, only=("rollout",))  # ranks alone vote
            else:
                check_exposed(addresses[rank], "the engine vote", insecure=insecure)
            self._pull = self._context.socket(zmq.PULL)
            self._pull.setsockopt(zmq.LINGER, 0)
            self._pull.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME)
            if server_security is not None:
                server_security.apply(self._pull)
            attach(self._pull.bind, addresses[rank], "engine vote: cannot bind this rank's vote")
            self._push: dict[int, zmq.Socket] = {}
            for peer, address in enumerate(addresses):
                if peer != rank:
                    sock = self._context.socket(zmq.PUSH, socket_class=zmq.Socket)  # type: ignore[arg-type]  # plain: sends never wait
                    self._push[peer] = sock  # before anything can fail: _teardown closes it, or term() waits forever
                    sock.setsockopt(zmq.LINGER, 0)
                    if client_security is not None:
                        client_security.apply(sock)
                    # queued until the peer binds; never blocks the vote
                    attach(sock.connect, address, f"engine vote: cannot reach rank {peer}'s vote")
        except BaseException:
            self._teardown(0)
            raise
        self._changed = asyncio.Event()
        self._pump: asyncio.Task[None] | None = None
        self._deadline: tuple[int, float] | None = None  # the coordinator's own attempt and its deadline
        self.dropped = 0  # messages refused (malformed, foreign, too large)
        self.closed = False

    def start(self) -> None:
        """Start answering peers (done by the first vote or resolve, and by ``async with``)."""
        if self.closed:
            raise ConfigError("this vote channel is closed")
        if self._pump is None:
            self._pump = asyncio.get_running_loop().create_task(self._run_pump())

    async def vote(self, ballot: Ballot, timeout: float) -> Verdict:
        self.start()
        attempt = self._begin_attempt()
        if self.node.register is not None:
            self._deadline = (attempt, time.monotonic() + timeout)
        self._send(self.node.vote(attempt, ballot))
        verdict = await self._await(attempt, timeout, lambda: self.node.tick(attempt))
        if verdict is None:  # our deadline: the coordinator writes ABORT unless something is written
            self._send(self.node.expire(attempt))
            verdict = await self._await(attempt, self.settle_s, lambda: self.node.expire(attempt))
        return verdict or Verdict(attempt, Decision.IN_DOUBT, None, "no verdict from the coordinator")

    async def resolve(self, attempt: int, timeout: float) -> Verdict:
        self.start()
        self._send(self.node.query(attempt))
        verdict = await self._await(attempt, timeout, lambda: self.node.query(attempt))
        return verdict or Verdict(attempt, Decision.IN_DOUBT, None, "no peer knows the verdict yet")

    async def _await(self, attempt: int, timeout: float, again: Any) -> Verdict | None:
        """Until this rank knows the verdict (or ``timeout``), saying ``again()`` every ``resend_s``."""
        with anyio.move_on_after(timeout):
            while (verdict := self.node.verdict(attempt)) is None:
                changed = self._changed
                with anyio.move_on_after(self.resend_s) as quiet:
                    await changed.wait()
                if quiet.cancelled_caught:
                    self._send(again())
            return verdict
        return self.node.verdict(attempt)

    async def _run_pump(self) -> None:
        try:
            while True:
                data = await self._pull.recv()
                self._expire_own()
                try:
                    m = decode_vote(data, group=self.group, rank=self.rank, size=self.size)
                except Exception as exc:  # malformed, foreign or forged-looking: never counted
                    self.dropped += 1
                    log.warning("engine vote: dropped a message: %.200s", exc)
                    continue
                self._send(self.node.receive(m))
                self._changed.set()
                self._changed = asyncio.Event()
        except (asyncio.CancelledError, zmq.ZMQError):
            pass

    def _expire_own(self) -> None:
        """A coordinator past its own deadline writes ABORT before it reads anything older."""
        if self._deadline is not None and time.monotonic() >= self._deadline[1]:
            attempt, self._deadline = self._deadline[0], None
            self._send(self.node.expire(attempt))

    def _send(self, messages: list[Message]) -> None:
        for m in messages:
            try:
                self._push[m.to].send(encode_vote(self.group, m), flags=zmq.NOBLOCK)
            except zmq.Again:  # the peer's queue is full: it is not reading; it will ask again
                pass

    def _teardown(self, push_linger_ms: int) -> None:
        for sock in getattr(self, "_push", {}).values():  # a last verdict still queued gets a moment
            sock.close(linger=push_linger_ms)
        if hasattr(self, "_pull"):
            self._pull.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        self._context.term()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self._pump is not None:
                self._pump.cancel()
            self._teardown(int(self.linger_s * 1000))

    async def __aenter__(self) -> ZmqVote:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._pump is not None:
            self._pump.cancel()
            await asyncio.gather(self._pump, return_exceptions=True)
        self.close()
