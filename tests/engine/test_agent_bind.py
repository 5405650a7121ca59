"""An engine agent whose address is taken says so at once (a typed error), holds nothing open, and
leaves its rank serving."""

from __future__ import annotations

import threading

import anyio
import anyio.to_thread
import pytest
import zmq

import refitflow as rf
from tests.conftest import free_addresses, mlp


@pytest.mark.asyncio
async def test_an_agent_whose_address_is_taken_raises_config_error_and_the_rank_still_refits(ident, registry) -> None:
    address, vote = free_addresses(2)
    ctx = zmq.Context()
    squatter = ctx.socket(zmq.ROUTER)
    squatter.bind(address)  # another process's socket, say
    failures: list[BaseException] = []
    try:
        with anyio.fail_after(30):
            async with (
                rf.Publisher(registry, identity=ident) as pub,
                rf.Receiver(mlp(2), registry, identity=ident) as recv,
                rf.ZmqVote(0, [vote]) as channel,
            ):
                agent = rf.EngineAgent(rf.EngineMember(recv, channel), address)

                def serve() -> None:  # in a thread of its own: a serve() that blocks its loop cannot hang the test
                    try:
                        anyio.run(agent.serve)
                    except BaseException as exc:
                        failures.append(exc)

                runner = threading.Thread(target=serve, daemon=True)
                runner.start()
                await anyio.to_thread.run_sync(runner.join, 10.0)
                assert not runner.is_alive(), "serve() did not return after its bind failed"
                assert len(failures) == 1 and isinstance(failures[0], rf.ConfigError), failures
                assert "cannot bind the engine agent" in str(failures[0]) and address in str(failures[0])
                await pub.publish(1, dict(mlp(1).named_parameters()))
                result = await recv.refit(1)  # the rank itself is untouched
                assert result.version == 1 and recv.status.committed_version == 1
    finally:
        ctx.destroy(linger=0)
