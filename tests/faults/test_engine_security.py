"""CURVE on the engine's sockets: a forged ballot is never counted, a forged command never obeyed.

Before, one forged PUSH message made two ranks commit a vote the third never cast, and forged
``refit``/``stop`` commands were obeyed. Now the vote's PULL sockets and the agent's ROUTER are CURVE
servers admitting only the deployment's allow-list (``refitflow keys``): a process with no key or
an unknown key never completes the handshake, so nothing it sends reaches the protocol.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import anyio
import pytest
import zmq
import zmq.asyncio
from zmq.auth import create_certificates, load_certificate

import refitflow as rf
from refitflow.cli.registry_cmd import keys_main
from refitflow.core.wire import encode
from refitflow.engine.commitment import Kind, Message
from refitflow.engine.vote import Ballot, Decision, Verdict
from refitflow.engine.zmq_vote import encode_vote
from tests.conftest import free_addresses, mlp


def _keys(tmp_path: Path) -> tuple[rf.ServerSecurity, rf.ClientSecurity, Path]:
    """The deployment's key set, as ``refitflow keys`` writes it; and an intruder's key pair outside it."""
    keys_main([str(tmp_path / "keys"), "--clients", "rank:rollout"])  # an engine rank: the rollout role
    _, intruder = create_certificates(str(tmp_path), "intruder")
    server = rf.ServerSecurity(secret_key_file=tmp_path / "keys/server.key_secret",
                               authorized_dir=tmp_path / "keys/authorized")  # fmt: skip
    client = rf.ClientSecurity(secret_key_file=tmp_path / "keys/rank.key_secret",
                               server_public_file=tmp_path / "keys/server.key")  # fmt: skip
    return server, client, Path(intruder)


def _intruders(ctx: zmq.asyncio.Context, kind: int, address: str, tmp_path: Path, intruder: Path) -> list:
    """Three senders: no CURVE at all, an unknown key, and an unknown key pretending to know the server."""
    plain = ctx.socket(kind)
    unknown = ctx.socket(kind)
    public, secret = load_certificate(str(intruder))
    server_public, _ = load_certificate(str(tmp_path / "keys/server.key"))
    unknown.curve_publickey, unknown.curve_secretkey, unknown.curve_serverkey = public, secret, server_public
    for s in (plain, unknown):
        s.setsockopt(zmq.LINGER, 0)
        s.connect(address)
    return [plain, unknown]


@contextmanager
def _voting(ranks: list[rf.ZmqVote]) -> Iterator[zmq.asyncio.Context]:
    """The ranks started, and a context for the intruders' sockets; all of it closed at the end."""
    ctx = zmq.asyncio.Context()
    try:
        for r in ranks:
            r.start()
        yield ctx
    finally:
        ctx.destroy(linger=0)
        for r in ranks:
            r.close()


@pytest.mark.asyncio
async def test_a_forged_ballot_or_verdict_is_never_counted(tmp_path: Path) -> None:
    server, client, intruder = _keys(tmp_path)
    addrs = free_addresses(3)
    ranks = [rf.ZmqVote(r, addrs, server_security=server, client_security=client) for r in range(3)]
    with _voting(ranks) as ctx, anyio.fail_after(30):
        forged_ballot = encode_vote("engine", Message(Kind.BALLOT, 1, 2, 0, ballot=Ballot(True, True, 1)))
        forged_commit = encode_vote(
            "engine", Message(Kind.DECISION, 1, 0, 1, verdict=Verdict(1, Decision.COMMIT, 1, "forged"))
        )
        for sock in _intruders(ctx, zmq.PUSH, addrs[0], tmp_path, intruder):
            await sock.send(forged_ballot)  # "rank 2 is ready", to the coordinator
        for sock in _intruders(ctx, zmq.PUSH, addrs[1], tmp_path, intruder):
            await sock.send(forged_commit)  # "the engine committed", to rank 1
        verdicts = {}

        async def vote(r: int) -> None:
            verdicts[r] = await ranks[r].vote(Ballot(True, True, 1), 2)

        async with anyio.create_task_group() as tg:  # rank 2 never votes
            tg.start_soon(vote, 0)
            tg.start_soon(vote, 1)
        assert {v.decision for v in verdicts.values()} == {Decision.ABORT}, verdicts
        assert "no ballot of ranks [2] had been read" in verdicts[0].reason
        assert all(r.dropped == 0 for r in ranks)  # nothing even reached the decoder
        # the deployment's own keys still work: rank 2 votes late and learns the verdict
        assert (await ranks[2].vote(Ballot(True, True, 1), 5)).decision is Decision.ABORT


@pytest.mark.asyncio
async def test_a_key_of_another_role_in_the_deployment_cannot_vote(tmp_path: Path) -> None:
    """Keys per role reach the engine: its vote admits the deployment's rollout keys alone. A trainer's key — the
    same folder, the same server key — is refused at the handshake, so its forged ballot is never counted."""
    keys_main([str(tmp_path / "keys"), "--clients", "rank:rollout", "coach:trainer"])
    server = rf.ServerSecurity(secret_key_file=tmp_path / "keys/server.key_secret",
                               authorized_dir=tmp_path / "keys/authorized")  # fmt: skip
    rank = rf.ClientSecurity(secret_key_file=tmp_path / "keys/rank.key_secret",
                             server_public_file=tmp_path / "keys/server.key")  # fmt: skip
    coach = rf.ClientSecurity(secret_key_file=tmp_path / "keys/coach.key_secret",
                              server_public_file=tmp_path / "keys/server.key")  # fmt: skip
    addrs = free_addresses(2)
    ranks = [rf.ZmqVote(r, addrs, server_security=server, client_security=rank) for r in range(2)]
    with _voting(ranks) as ctx, anyio.fail_after(30):
        trainer = ctx.socket(zmq.PUSH)
        trainer.setsockopt(zmq.LINGER, 0)
        coach.apply(trainer)
        trainer.connect(addrs[0])
        await trainer.send(encode_vote("engine", Message(Kind.BALLOT, 1, 1, 0, ballot=Ballot(True, True, 1))))
        verdict = await ranks[0].vote(Ballot(True, True, 1), 2)  # "rank 1 is ready", from the trainer's key
        assert verdict.decision is Decision.ABORT, verdict
        assert "no ballot of ranks [1] had been read" in verdict.reason
        assert ranks[0].dropped == 0  # refused at the handshake: nothing reached the decoder
        assert (await ranks[1].vote(Ballot(True, True, 1), 5)).decision is Decision.ABORT  # the rank's key votes


@pytest.mark.asyncio
async def test_forged_refit_and_stop_commands_are_never_obeyed(tmp_path: Path, ident, registry) -> None:
    server, client, intruder = _keys(tmp_path)
    [vote_address, agent_address] = free_addresses(2)
    ctx = zmq.asyncio.Context()
    try:
        with anyio.fail_after(40):
            async with (
                rf.Publisher(registry, identity=ident) as pub,
                rf.Receiver(mlp(2), registry, identity=ident) as recv,
                rf.ZmqVote(0, [vote_address], server_security=server, client_security=client) as channel,
                anyio.create_task_group() as tg,
            ):
                await pub.publish(1, dict(mlp(1).named_parameters()))
                agent = rf.EngineAgent(rf.EngineMember(recv, channel), agent_address, security=server)
                tg.start_soon(agent.serve)
                controller = rf.Controller({"e": [agent_address]}, security=client)
                assert (await controller.status())["e"][0] is not None  # the deployment's controller is heard
                for sock in _intruders(ctx, zmq.DEALER, agent_address, tmp_path, intruder):
                    await sock.send(encode({"op": "refit", "id": 10**15, "version": 1, "timeout": 5}))
                    await sock.send(encode({"op": "stop", "id": 10**15 + 1}))
                await anyio.sleep(1.0)  # long enough for a handshake that was going to succeed
                status = (await controller.status())["e"][0]
                assert status is not None and status["committed_version"] is None  # still serving, no refit
                assert recv.ledger.last_begun is None
                unsecured = rf.Controller({"e": [agent_address]})  # a controller without the keys is not heard
                assert (await unsecured.status(timeout=1.0))["e"] == [None]
                result = await controller.refit(1, timeout=10)
                assert result["e"].committed and recv.status.committed_version == 1
                await controller.stop_agents()
    finally:
        ctx.destroy(linger=0)
