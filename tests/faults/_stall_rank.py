"""One rank of a 3-rank engine for the stall tests: it stops itself (SIGSTOP) at a chosen step of the vote.

Each rank has its own publisher of the same weights (loopback) and a receiver writing in place; the
vote is ZMQ or gloo (the c10d store of a gloo group whose store rank 0 hosts). A rank reports its
first outcome, then — if in doubt — asks its peers until it learns the verdict, and reports again.
"""

from __future__ import annotations

import datetime
import os
import signal
import time
from typing import Any

import anyio
import torch

import refitflow as rf
from refitflow.engine.vote import Ballot, Verdict, VoteChannel
from tests.conftest import mlp, params, same


class StallAt:
    """A vote channel that stops this whole process before its ballot leaves, or just after."""

    def __init__(self, inner: VoteChannel, step: str) -> None:
        self.inner, self.step = inner, step
        self.rank, self.size = inner.rank, inner.size

    @property
    def attempt(self) -> int:
        return self.inner.attempt

    async def vote(self, ballot: Ballot, timeout: float) -> Verdict:
        if self.step == "before":
            os.kill(os.getpid(), signal.SIGSTOP)  # resumed by the test, long past every deadline
            return await self.inner.vote(ballot, timeout)
        got: list[Verdict] = []

        async def run() -> None:
            got.append(await self.inner.vote(ballot, timeout))

        async with anyio.create_task_group() as tg:
            tg.start_soon(run)
            await anyio.sleep(0.3)  # the ballot has left; the verdict may be on its way
            os.kill(os.getpid(), signal.SIGSTOP)
        return got[0]

    async def resolve(self, attempt: int, timeout: float) -> Verdict:
        return await self.inner.resolve(attempt, timeout)


def _state(recv: rf.Receiver, server: torch.nn.Module, new: dict, old: dict, outcome: Any) -> dict[str, Any]:
    return {"decision": outcome.decision.value if outcome else None, "fence": recv.fence.state.value,
            "committed_version": recv.status.committed_version, "serves_new": same(server, new),
            "serves_old": same(server, old)}  # fmt: skip


async def _rank(rank: int, channel: VoteChannel, stall: tuple[int, str], queue: Any) -> None:
    if rank == stall[0]:
        channel = StallAt(channel, stall[1])
    registry, ident = rf.Registry(), rf.Identity(model="engine")
    trainer, server = mlp(100, dtype=torch.bfloat16), mlp(rank)
    old, new = params(server), {n: t.float() for n, t in params(trainer).items()}
    with anyio.fail_after(120):
        async with (
            rf.Publisher(registry, identity=ident) as pub,
            rf.Receiver(server, registry, identity=ident, budget_bytes=8192) as recv,
        ):
            await pub.publish(1, dict(trainer.named_parameters()))
            member = rf.EngineMember(recv, channel, vote_timeout=3, resolve_timeout=2)
            outcome = await member.refit(1, timeout=10)
            queue.put((rank, "first", _state(recv, server, new, old, outcome)))
            while member.in_doubt is not None:  # ask the peers until one knows
                resolved = await member.resolve()
                outcome = resolved or outcome
                await anyio.sleep(0.2)
            queue.put((rank, "final", _state(recv, server, new, old, outcome)))
            await anyio.sleep(3)  # stay a moment: a peer may still ask this rank for the verdict


def run_rank(rank: int, ports: list[int], kind: str, stall: tuple[int, str], queue: Any) -> None:
    torch.set_num_threads(1)
    if kind == "zmq":
        channel: Any = rf.ZmqVote(rank, [f"tcp://127.0.0.1:{p}" for p in ports])
    else:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports[0]}", rank=rank, world_size=3,
                                timeout=datetime.timedelta(seconds=60))  # fmt: skip
        channel = rf.GlooVote()
    try:
        anyio.run(_rank, rank, channel, stall, queue)
    except BaseException as exc:
        queue.put((rank, "final", {"error": repr(exc)}))
    if kind == "zmq":
        channel.close()
    else:  # rank 0 hosts the store: it leaves last
        channel.store.add("left", 1)
        deadline = time.monotonic() + 30
        while rank == 0 and int(channel.store.add("left", 0)) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
    queue.close()
    queue.join_thread()
    os._exit(0)
