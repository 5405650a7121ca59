"""The controller's fleet changes under it: engines (one rank process each: a NIXL receiver that relays, an
agent) join, are killed, and are replaced on other addresses; a joiner refits the fleet's version at once,
every byte from its peers; ``states()`` tells a router which engines are current. The publisher's process is
replaced too: the next refit reads from the new one, nobody else restarted."""

from __future__ import annotations

import json
import pathlib
import socket
import sys
import tempfile

import anyio
import pytest

import refitflow as rf
from tests.transports._nixl_peer import LineChild, Peer

ROOT = str(pathlib.Path(__file__).resolve().parents[2])
SPEC = {"tensors": 32, "numel": 4000, "model": "fleet"}


class Engine(LineChild):
    """``_agent_rank`` in its own process, its agent on ``address``."""

    def __init__(self, registry: str, address: str) -> None:
        argv = [sys.executable, "-m", "tests.engine._agent_rank", json.dumps(SPEC), registry, address]
        super().__init__(argv, path=[ROOT])
        self.address = address

    async def holds(self, seed: int) -> bool:
        return bool((await self._ask({"holds": seed}))["holds"])


def _address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def _states(states: dict[str, rf.EngineState]) -> dict[str, tuple[str, int | None]]:
    return {name: (s.state, s.version) for name, s in states.items()}


@pytest.mark.asyncio
async def test_engines_join_die_and_are_replaced_and_a_joiner_catches_up_from_its_peers() -> None:
    registry = _address()
    with tempfile.TemporaryDirectory(prefix="rf-fleet-") as where, anyio.fail_after(180):
        agent = {name: f"ipc://{where}/{name}" for name in ("a", "b", "c", "b-again")}
        async with rf.Registry.serve(registry) as server, Peer(SPEC) as trainer:
            await server.registry.publish(await trainer.publish(1, 1))
            async with Engine(registry, agent["a"]) as a, Engine(registry, agent["b"]) as b:
                controller = rf.Controller({"a": [a.address], "b": [b.address]})
                assert all(r.committed for r in (await controller.refit(1, timeout=30)).values())
                assert controller.version == 1 and await a.holds(1) and await b.holds(1)

                async with Engine(registry, agent["c"]) as c:
                    joined = await controller.join("c", [c.address], timeout=30)
                    (rank,) = joined.ranks
                    assert joined.committed and joined.version == 1 and await c.holds(1), joined
                    assert rank.relay_bytes == rank.pulled_bytes > 0, rank  # every byte from a peer
                    assert _states(await controller.states()) == {"a": ("current", 1), "b": ("current", 1),
                                                                  "c": ("current", 1)}  # fmt: skip

                    await b.kill()
                    states = await controller.states(timeout=2)
                    assert states["b"].state == "gone" and not states["b"].ready, states
                    assert states["a"].ready and states["c"].ready, states
                    controller.remove("b")
                    await server.registry.publish(await trainer.publish(2, 2))
                    results = await controller.refit(2, timeout=30)
                    assert set(results) == {"a", "c"} and all(r.committed for r in results.values()), results

                    async with Engine(registry, agent["b-again"]) as again:  # b, replaced on another address
                        joined = await controller.join("b", [again.address], timeout=30)
                        assert joined.committed and joined.version == 2 and await again.holds(2), joined
                        assert joined.ranks[0].relay_bytes == joined.ranks[0].pulled_bytes > 0, joined
                        states = await controller.states()
                        assert _states(states) == {"a": ("current", 2), "b": ("current", 2), "c": ("current", 2)}

                        await trainer.kill()  # the publisher rank, replaced by a new process (a new NIXL agent)
                        async with Peer(SPEC) as replaced:
                            await server.registry.publish(await replaced.publish(3, 3))
                            results = await controller.refit(3, timeout=30)
                            assert all(r.committed and r.version == 3 for r in results.values()), results
                            assert await a.holds(3) and await c.holds(3) and await again.holds(3)
                        await controller.stop_agents()
