"""An engine agent whose address is taken says so at once (a typed error), holds nothing open, and
leaves its rank serving."""

from __future__ import annotations

import anyio
import anyio.to_thread
import pytest
import zmq

import refitflow as rf
from tests._procs import ends_within
from tests.conftest import free_addresses, mlp


@pytest.mark.asyncio
async def test_an_agent_whose_address_is_taken_raises_config_error_and_the_rank_still_refits(ident, registry) -> None:
    address, vote = free_addresses(2)
    ctx = zmq.Context()
    squatter = ctx.socket(zmq.ROUTER)
    squatter.bind(address)  # another process's socket, say
    try:
        with anyio.fail_after(30):
            async with (
                rf.Publisher(registry, identity=ident) as pub,
                rf.Receiver(mlp(2), registry, identity=ident) as recv,
                rf.ZmqVote(0, [vote]) as channel,
            ):
                agent = rf.EngineAgent(rf.EngineMember(recv, channel), address)

                # in a thread of its own: a serve() that blocks its loop fails the test instead of hanging it
                failure = await anyio.to_thread.run_sync(ends_within, lambda: anyio.run(agent.serve), 10.0)
                assert isinstance(failure, rf.ConfigError), failure
                assert "cannot bind the engine agent" in str(failure) and address in str(failure)
                await pub.publish(1, dict(mlp(1).named_parameters()))
                result = await recv.refit(1)  # the rank itself is untouched
                assert result.version == 1 and recv.status.committed_version == 1
    finally:
        ctx.destroy(linger=0)
