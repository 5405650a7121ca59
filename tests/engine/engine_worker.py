"""One rank of a test engine, in its own process: a vote channel (gloo group or ZMQ), its own
publisher/registry, a receiver."""

from __future__ import annotations

import datetime
import os
import time
from typing import Any

import anyio
import torch

import refitflow as rf
from refitflow.engine.gloo_vote import GlooVote
from refitflow.engine.member import EngineMember
from refitflow.engine.vote import Ballot, Verdict, VoteChannel
from refitflow.engine.zmq_vote import ZmqVote
from tests.conftest import FailAt, mlp, params, same


class DieBeforeVote:
    """Killed mid-vote: prepared, never votes."""

    def __init__(self, channel: VoteChannel) -> None:
        self.rank, self.size, self.attempt = channel.rank, channel.size, 0

    async def vote(self, ballot: Ballot, timeout: float) -> Verdict:
        os._exit(3)

    async def resolve(self, attempt: int, timeout: float) -> Verdict:
        os._exit(3)


async def _rank(rank: int, scenario: str, mode: str, channel: VoteChannel) -> dict[str, Any]:
    if scenario == "killed" and rank == 2:
        channel = DieBeforeVote(channel)
    registry, ident = rf.Registry(), rf.Identity(model="engine")
    trainer, server = mlp(100, dtype=torch.bfloat16), mlp(rank)
    old = params(server)
    observer = FailAt("apply") if (scenario == "fail" and rank == 1) else FailAt("none")
    async with (
        rf.Publisher(registry, identity=ident) as pub,
        rf.Receiver(server, registry, identity=ident, mode=mode, observer=observer, budget_bytes=8192) as recv,
    ):
        await pub.publish(1, dict(trainer.named_parameters()))
        if scenario == "refuse" and rank == 2:
            await recv.refit(1)  # this rank already took version 1 on its own: it will refuse it
            old = params(server)
        outcome = await EngineMember(recv, channel, vote_timeout=15).refit(1, timeout=10)
        new = {n: t.float() for n, t in params(trainer).items()}
        return {
            "decision": outcome.decision.value,
            "committed": outcome.committed,
            "fence": recv.fence.state.value,
            "serves_new": same(server, new),
            "serves_old": same(server, old),
            "reason": outcome.reason,
        }


def _channel(kind: str, rank: int, ports: list[int]) -> VoteChannel:
    if kind == "zmq":
        return ZmqVote(rank, [f"tcp://127.0.0.1:{p}" for p in ports])
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{ports[0]}", rank=rank, world_size=len(ports),
        timeout=datetime.timedelta(seconds=20),
    )  # fmt: skip
    return GlooVote()


def run_rank(rank: int, ports: list[int], scenario: str, mode: str, kind: str, queue: Any) -> None:
    torch.set_num_threads(1)
    channel = _channel(kind, rank, ports)
    try:
        queue.put((rank, anyio.run(_rank, rank, scenario, mode, channel)))
    except BaseException as exc:
        queue.put((rank, {"error": repr(exc)}))
    if isinstance(channel, ZmqVote):
        channel.close()  # lets a last queued verdict leave
    elif isinstance(channel, GlooVote) and scenario != "killed":  # rank 0 hosts the store: leave together
        channel.store.add("left", 1)
        while channel.rank == 0 and int(channel.store.add("left", 0)) < channel.size:
            time.sleep(0.05)
    queue.close()
    queue.join_thread()  # flush before leaving without running the group's destructor
    os._exit(0)  # the group may be broken (a peer died): do not wait in its destructor
