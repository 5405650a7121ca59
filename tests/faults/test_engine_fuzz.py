"""Hypothesis fuzzing of every message the vote and the agent accept: never a crash, never counted.

Frames are arbitrary bytes, or JSON objects whose fields are any JSON value (wrong types, out of
range, missing, extra); sequences of well-formed messages arrive in any order, in any rank's name,
for any attempt. The decoders raise only ``ValueError``; a coordinator that did not vote writes
nothing; a COMMIT is only ever written with every rank's ready ballot for one version; a rank never
lets a later verdict replace the first it learned. Then the same garbage goes to live sockets, and
the vote and the agent go on working.
"""

from __future__ import annotations

import json
from unittest.mock import ANY

import anyio
import orjson
import pytest
import zmq
import zmq.asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import refitflow as rf
from refitflow.core.wire import encode
from refitflow.engine.agent import parse_command
from refitflow.engine.commitment import Kind, Message, Node
from refitflow.engine.vote import Ballot, Decision, Verdict
from refitflow.engine.zmq_vote import decode_vote, encode_vote
from tests.conftest import free_addresses, mlp


def _json(value: object) -> bytes:
    return json.dumps(value).encode()  # big integers and infinities too (orjson refuses to write them)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=10,
)
vote_fields = st.fixed_dictionaries(
    {},
    optional={
        "g": st.sampled_from(["engine", "other"]) | json_values,
        "k": st.sampled_from([k.value for k in Kind]) | json_values,
        "a": st.integers(-3, 2**64) | json_values,
        "r": st.integers(-1, 4) | json_values,
        "b": st.lists(st.booleans() | st.integers(-2, 9) | json_values, max_size=4),
        "d": st.lists(st.sampled_from([d.value for d in Decision]) | st.integers(-2, 9) | json_values, max_size=4),
    },
)
command_fields = st.fixed_dictionaries(
    {},
    optional={
        "op": st.sampled_from(["refit", "status", "stop", "kill"]) | json_values,
        "id": st.integers(-3, 2**64) | json_values,
        "version": st.integers(-3, 2**64) | json_values,
        "timeout": st.floats() | st.integers(-5, 10**6) | json_values,
    },
)
frames = st.binary(max_size=300) | vote_fields.map(_json) | command_fields.map(_json)


@given(frames)
@settings(max_examples=400, deadline=None)
def test_a_vote_message_is_either_valid_or_a_value_error(frame: bytes) -> None:
    try:
        m = decode_vote(frame, group="engine", rank=1, size=3)
    except ValueError:
        return
    assert m.to == 1 and m.sender in (0, 2) and m.attempt >= 0
    assert (m.ballot is not None) == (m.kind is Kind.BALLOT) and (m.verdict is not None) == (m.kind is Kind.DECISION)
    if m.verdict is not None:
        assert m.verdict.decision is not Decision.IN_DOUBT
        assert (m.verdict.decision is Decision.COMMIT) == (m.verdict.version is not None)
    assert decode_vote(encode_vote("engine", m), group="engine", rank=1, size=3) == m  # round trip


@given(frames)
@settings(max_examples=400, deadline=None)
def test_a_command_is_either_valid_or_a_value_error(frame: bytes) -> None:
    try:
        c = parse_command(frame)
    except ValueError:
        return
    assert c["op"] in ("refit", "status", "stop") and type(c["id"]) is int and c["id"] >= 0
    if c["op"] == "refit":
        assert c["version"] is None or (type(c["version"]) is int and c["version"] >= 0)
        assert 0 < c["timeout"] <= 86400


ballots = st.builds(Ballot, st.booleans(), st.booleans(), st.integers(-1, 3))
verdicts = st.builds(Verdict, st.integers(0, 6), st.sampled_from([Decision.COMMIT, Decision.ABORT, Decision.NOTHING]),
                     st.none() | st.integers(0, 3))  # fmt: skip
messages = st.builds(
    Message, st.sampled_from(list(Kind)), st.integers(0, 6), st.integers(1, 2), st.just(0),
    ballot=ballots, verdict=verdicts,
)  # fmt: skip


@given(st.lists(messages, max_size=30), st.none() | st.tuples(st.integers(0, 6), ballots))
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_out_of_order_and_forged_messages_never_make_the_coordinator_commit_without_every_ballot(
    sequence: list[Message], own: tuple[int, Ballot] | None
) -> None:
    node = Node(0, 3)
    seen: dict[int, dict[int, Ballot]] = {}
    for i, m in enumerate(sequence):
        if own is not None and i == len(sequence) // 2:
            node.vote(own[0], own[1])
            seen.setdefault(own[0], {}).setdefault(0, own[1])
        if m.kind is Kind.BALLOT and m.ballot is not None:
            seen.setdefault(m.attempt, {}).setdefault(m.sender, m.ballot)
        out = node.receive(m)
        assert all(o.kind is Kind.DECISION and o.sender == 0 for o in out)
    assert node.register is not None
    if own is None or (own[0] > max((m.attempt for m in sequence), default=-1) and not sequence):
        assert not node.register.verdicts or own is not None
    for attempt, v in node.register.verdicts.items():
        if v.decision is Decision.COMMIT:  # every rank's first ballot, ready, one version
            held = seen[attempt]
            assert set(held) == {0, 1, 2} and all(b.ready and b.version == v.version for b in held.values())
    if own is None:
        assert not node.register.verdicts  # a coordinator that never voted writes nothing


@given(st.lists(messages.map(lambda m: Message(m.kind, m.attempt, 0, 1, m.ballot, m.verdict)), max_size=30))
@settings(max_examples=300, deadline=None)
def test_a_participant_keeps_the_first_verdict_it_learns(sequence: list[Message]) -> None:
    node = Node(1, 3)
    first: dict[int, tuple] = {}
    for m in sequence:
        if m.kind is Kind.DECISION and m.verdict is not None:
            v = Verdict(m.attempt, m.verdict.decision, m.verdict.version)
            first.setdefault(m.attempt, (v.decision, v.version))
            m = Message(m.kind, m.attempt, m.sender, m.to, verdict=v)
        node.receive(m)
    assert {a: (v.decision, v.version) for a, v in node.known.items()} == first


GARBAGE = [
    b"", b"not json", b"[]", b"{}", b"null", orjson.dumps({"g": "engine", "k": "ballot"}),
    orjson.dumps({"g": "engine", "k": "decision", "a": 1, "r": 1, "d": ["commit", None, ""]}),
    orjson.dumps({"g": "engine", "k": "ballot", "a": 1, "r": 0, "b": [True, True, 1]}),  # in rank 0's own name
    orjson.dumps({"g": "engine", "k": "ballot", "a": True, "r": 1, "b": [True, True, 1]}),
    orjson.dumps({"op": "refit", "id": "1"}), orjson.dumps({"op": "stop", "id": -1}),
    _json({"op": "refit", "id": 1, "timeout": float("inf")}), orjson.dumps({"op": "kill", "id": 1}),
]  # fmt: skip


@pytest.mark.asyncio
async def test_garbage_on_the_live_sockets_is_never_counted_or_obeyed(ident, registry) -> None:
    vote_address, agent_address = free_addresses(2)
    ctx = zmq.asyncio.Context()
    try:
        with anyio.fail_after(30):
            async with (
                rf.Publisher(registry, identity=ident) as pub,
                rf.Receiver(mlp(2), registry, identity=ident) as recv,
                rf.ZmqVote(0, [vote_address, free_addresses(1)[0]], resend_s=0.05) as channel,
                anyio.create_task_group() as tg,
            ):
                await pub.publish(1, dict(mlp(1).named_parameters()))
                agent = rf.EngineAgent(rf.EngineMember(recv, channel), agent_address)
                tg.start_soon(agent.serve)
                push, dealer = ctx.socket(zmq.PUSH), ctx.socket(zmq.DEALER)
                push.connect(vote_address)
                dealer.connect(agent_address)
                for frame in GARBAGE:
                    await push.send(frame)
                    await dealer.send(frame)
                await dealer.send_multipart([b"two", b"frames"])
                answers = [orjson.loads(await dealer.recv()) for _ in GARBAGE]
                assert all(a["ok"] is False and a["id"] is None for a in answers)  # refused, and said so
                # a peer's real ballot after the garbage, on the same connection (in order): it still counts
                await push.send(encode_vote("engine", Message(Kind.BALLOT, 1, 1, 0, ballot=Ballot(True, True, 1))))
                verdict = await channel.vote(Ballot(True, True, 1), 5)
                assert (verdict.decision, verdict.version) == (Decision.COMMIT, 1)
                assert channel.dropped == len(GARBAGE) and list(channel.node.known) == [1]
                for sock in (push, dealer):  # too large: ZMQ drops the connection, which comes back
                    await sock.send(b"\x00" * 5000)
                for request_id in range(5, 25):  # a request sent while the connection drops is lost: ask again
                    await dealer.send(encode({"op": "status", "id": request_id}))
                    with anyio.move_on_after(0.5):
                        answer = orjson.loads(await dealer.recv())
                        break
                assert answer == {"id": ANY, "ok": True, "result": ANY} and 5 <= answer["id"] <= request_id  # serving
                assert recv.ledger.last_begun is None and agent.refused == len(GARBAGE) + 1  # nothing obeyed
                await dealer.send(encode({"op": "stop", "id": 99}))
                await dealer.recv()
                push.close(0)
                dealer.close(0)
    finally:
        ctx.destroy(linger=0)
