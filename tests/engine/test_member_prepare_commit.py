"""EngineMember's two halves, for hosts whose commit is a call of its own (vLLM's finish_weight_update)."""

from __future__ import annotations

import anyio
import pytest

import refitflow as rf
from refitflow.engine.solo_vote import SoloVote
from refitflow.engine.vote import Ballot, Decision
from tests.conftest import mlp, params, same


@pytest.mark.asyncio
async def test_a_one_rank_vote_decides_by_its_own_ballot_and_remembers_its_last_verdict() -> None:
    solo = SoloVote()
    ready = await solo.vote(Ballot(ready=True, began=True, version=3), timeout=1)
    assert (ready.attempt, ready.decision, ready.version, ready.reason) == (1, Decision.COMMIT, 3, "")
    failed = await solo.vote(Ballot(ready=False, began=True, version=4), timeout=1)
    assert (failed.attempt, failed.decision, failed.version) == (2, Decision.ABORT, None)
    assert "not ready" in failed.reason
    nothing = await solo.vote(Ballot(ready=False, began=False, version=-1), timeout=1)
    assert nothing.decision is Decision.NOTHING
    assert solo.attempt == 3 and await solo.resolve(3, timeout=1) == nothing
    assert (await solo.resolve(2, timeout=1)).decision is Decision.ABORT  # over, never in doubt


@pytest.mark.asyncio
async def test_prepare_leaves_the_version_invisible_until_commit_and_abort_drops_it(ident, registry) -> None:
    trainer, server = mlp(1), mlp(2)
    old = params(server)
    with anyio.fail_after(20):
        async with (
            rf.Publisher(registry, identity=ident) as pub,
            rf.Receiver(server, registry, identity=ident, mode="shadow") as recv,
        ):
            member = rf.EngineMember(recv, SoloVote())
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
