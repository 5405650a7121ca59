"""EngineMember's two halves, for hosts whose commit is a call of its own (vLLM's finish_weight_update)."""

from __future__ import annotations

import anyio
import pytest

import refitflow as rf
from refitflow.engine.vote import Ballot, Decision
from tests.conftest import mlp, params, same


class Solo:
    """The vote of an engine of one rank (no peer to ask)."""

    rank, size = 0, 1

    async def exchange(self, ballot: Ballot, timeout: float) -> list[Ballot | None]:
        return [ballot]


@pytest.mark.asyncio
async def test_prepare_leaves_the_version_invisible_until_commit_and_abort_drops_it(ident, registry) -> None:
    trainer, server = mlp(1), mlp(2)
    old = params(server)
    with anyio.fail_after(20):
        async with (
            rf.Publisher(registry, identity=ident) as pub,
            rf.Receiver(server, registry, identity=ident, mode="shadow") as recv,
        ):
            member = rf.EngineMember(recv, Solo())
            await pub.publish(1, dict(trainer.named_parameters()))
            outcome = await member.prepare(1, timeout=5)
            assert outcome.decision is Decision.COMMIT and not outcome.committed and same(server, old)
            done = await member.commit(outcome)
            assert done.committed and done.version == 1 and same(server, params(trainer))
            with pytest.raises(rf.VersionError, match="nothing prepared"):
                await member.commit(done)
            await pub.publish(2, dict(mlp(3).named_parameters()))
            outcome = await member.prepare(2, timeout=5)
            await member.abort(outcome, "the host gave up on it")
            assert same(server, params(trainer)) and recv.status.committed_version == 1 and not recv.status.in_progress
