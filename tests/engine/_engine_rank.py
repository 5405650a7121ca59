"""One rank process for the controller tests: its own publisher of the same weights, a receiver, a
ZMQ engine vote, and an EngineAgent answering the controller."""

from __future__ import annotations

import os
from typing import Any

import anyio
import torch

import refitflow as rf
from tests._procs import dumpable
from tests.conftest import FailAt, mlp


def _die() -> None:
    os._exit(5)  # killed mid-refit, after the first bucket was applied


async def _serve(rank: int, votes: list[str], agent: str, behaviour: str) -> None:
    registry, ident = rf.Registry(), rf.Identity(model="engine")
    trainer, server = mlp(100, dtype=torch.bfloat16), mlp(rank)
    observer = {"fail": FailAt("apply"), "die": FailAt("apply", action=_die)}.get(behaviour, FailAt("none"))
    with anyio.fail_after(90):  # every wait has a deadline: an agent nobody stops ends on its own
        async with (
            rf.Publisher(registry, identity=ident) as pub,
            rf.Receiver(server, registry, identity=ident, mode="shadow", observer=observer, budget_bytes=8192) as recv,
            rf.ZmqVote(rank, votes) as channel,
        ):
            await pub.publish(1, dict(trainer.named_parameters()))
            await rf.EngineAgent(rf.EngineMember(recv, channel, vote_timeout=5), agent).serve()


def serve_rank(rank: int, votes: list[str], agent: str, behaviour: str) -> None:
    dumpable()
    torch.set_num_threads(1)
    anyio.run(_serve, rank, votes, agent, behaviour)


def expected() -> dict[str, Any]:
    return {n: p.detach().float() for n, p in mlp(100, dtype=torch.bfloat16).named_parameters()}
