"""Hypothesis against a registry process: every op it accepts, with random and hostile arguments, and
frames of the wrong count or size. The service answers each with a result or a typed error of the
refitflow tree (never an internal failure), never crashes, and keeps serving — in memory and on etcd."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from zmq.utils.monitor import recv_monitor_message

from refitflow.core import errors
from refitflow.core.wire import PROTOCOL_VERSION
from refitflow.registry.service.ops import Handler
from tests.faults.conftest import STORES
from tests.registry._procs import spawn_registry, stop, sync_dealer
from tests.registry.test_registry_hostile import ask, hostile, junk

OPS = sorted(name[3:] for name in dir(Handler) if name.startswith("op_"))
LIMIT = 1 << 16  # the registry's max_message_bytes here: frames around it are cheap to send
TYPED = set(errors.__all__) - {"RefitError"}  # a bare RefitError reply is an internal failure
REAL_INC = "<the registry's incarnation>"  # replaced at send time, so deadlines get checked too


@pytest.fixture(scope="module", params=STORES)
def registry_address(request: pytest.FixtureRequest) -> Iterator[str]:
    """A registry process for the module, on each store (etcd: the session's cluster, a namespace of its own)."""
    store = [] if request.param == "memory" else ["--store", request.getfixturevalue("etcd_cluster").url,
                                                  "--namespace", uuid.uuid4().hex[:12]]  # fmt: skip
    loop = asyncio.new_event_loop()
    proc, address = loop.run_until_complete(
        asyncio.wait_for(spawn_registry("--lease-s", "30", "--max-message-bytes", str(LIMIT), *store), 30)
    )
    yield address
    loop.run_until_complete(stop(proc))
    loop.close()
    assert proc.returncode == -9, f"the registry process ended by itself (rc {proc.returncode}) during the fuzzing"


@pytest.fixture(scope="module")
def dealer(registry_address: str) -> Iterator[zmq.Socket[bytes]]:
    with sync_dealer(registry_address, timeout_ms=10_000) as sock:
        yield sock


def request(sock: zmq.Socket[bytes], msg: dict[str, Any]) -> dict[str, Any]:
    return ask(sock, orjson.dumps({"v": PROTOCOL_VERSION, "id": 7, **msg}))


def assert_typed(reply: dict[str, Any]) -> None:
    assert reply["ok"] is True or (reply["error"] in TYPED and reply["message"]), reply


def incarnation(sock: zmq.Socket[bytes]) -> str:
    return str(request(sock, {"op": "hello"})["result"]["incarnation"])


names = st.sampled_from(["w", "model.layers.0.mlp.down_proj.weight", "a\x00b", "a/b", "..", "", "é", "w" * 1100])
sizes = st.one_of(st.integers(-2, 8), st.sampled_from([2**31, 2**48 + 1, 10**12, 2**63, 2**64 - 1]))


@st.composite
def near_valid(draw: st.DrawFn) -> dict[str, Any]:
    """A manifest that is valid but for what the draws make of its name, sizes, ranks and digest."""
    axis = draw(st.one_of(st.none(), st.integers(-1, 10)))
    shard = [draw(names), "float32", draw(st.lists(sizes, max_size=10)), axis, draw(sizes), draw(sizes),
             draw(st.sampled_from(["0" * 16, "zz" * 8, "0"])), 0, 0]  # fmt: skip
    return {"identity": {"model": "fz"}, "version": draw(sizes), "rank": draw(st.integers(-1, 4)),
            "world_size": draw(sizes), "metadata": {}, "source": {"transport": "loopback", "agent": "a"},
            "shards": [shard]}  # fmt: skip


identities = st.one_of(st.sampled_from([{"model": "fz"}, {"model": "fz", "compile_target": "trt"}]), junk)
arguments = st.fixed_dictionaries({}, optional={
    "identity": identities, "version": st.one_of(sizes, junk), "min_version": st.one_of(sizes, junk),
    "owner": st.one_of(st.sampled_from(["o1", "o2"]), junk), "receiver_id": st.one_of(st.sampled_from(["r"]), junk),
    "manifest": st.one_of(near_valid(), hostile, junk),
    "policy": st.one_of(st.none(), st.fixed_dictionaries({}, optional={"receivers": sizes, "after_s": junk}), junk),
    "wait_s": st.one_of(st.floats(-10, 0.2), st.integers(-5, 0), st.text(max_size=3), st.none(), st.booleans()),
    "compile_targets": st.one_of(st.lists(st.sampled_from(["hf_raw", "trt"]), max_size=3), junk),
    "metadata": st.one_of(st.dictionaries(st.text(max_size=3), st.text(max_size=3), max_size=2), junk),
    "inc": st.one_of(st.just(REAL_INC), st.text(max_size=8), junk),
    "deadline": st.one_of(st.floats(allow_nan=False), st.integers(-(2**63), 2**63), junk),
    "id": junk,
})  # fmt: skip


@pytest.mark.parametrize("op", OPS)
def test_every_op_without_arguments_gets_an_answer(dealer: zmq.Socket[bytes], op: str) -> None:
    assert_typed(request(dealer, {"op": op}))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(op=st.one_of(st.sampled_from(OPS), junk), args=arguments)
def test_every_op_with_hostile_arguments_gets_a_typed_answer(dealer: zmq.Socket[bytes], op: Any, args: Any) -> None:
    if args.get("inc") == REAL_INC:
        args["inc"] = incarnation(dealer)
    assert_typed(request(dealer, {**args, "op": op}))
    assert request(dealer, {"op": "hello"})["ok"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(frames=st.lists(st.binary(max_size=64), min_size=2, max_size=5), size=st.integers(LIMIT - 64, 2 * LIMIT - 128))
def test_frames_of_the_wrong_count_or_size_get_typed_answers(
    dealer: zmq.Socket[bytes], frames: list[bytes], size: int
) -> None:
    reply = ask(dealer, *frames)
    assert reply["error"] == "ManifestError" and "one frame" in reply["message"]
    padded = orjson.dumps({"v": PROTOCOL_VERSION, "id": 9, "op": "hello", "pad": "x" * size})
    reply = ask(dealer, padded)
    assert reply["ok"] is (len(padded) <= LIMIT) and reply["id"] == 9
    if len(padded) > LIMIT:
        assert reply["error"] == "ManifestError" and "over the registry's limit" in reply["message"]


def next_event(monitor: zmq.Socket[bytes], wanted: int) -> None:
    """Read ``monitor`` until the event ``wanted`` (zmq.Again, a failure, if none comes in 5 s)."""
    while recv_monitor_message(monitor)["event"] != wanted:
        pass


def test_a_frame_far_over_the_limit_drops_only_its_connection(registry_address: str) -> None:
    with sync_dealer(registry_address) as huge, sync_dealer(registry_address) as fine:
        assert request(huge, {"op": "hello"})["ok"]
        monitor = huge.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED)
        monitor.setsockopt(zmq.RCVTIMEO, 5000)
        huge.send(b"x" * (3 * LIMIT))  # over twice the limit: ZMQ drops the connection unread
        assert request(fine, {"op": "hello"})["ok"]
        # A request sent before the dealer sees the drop goes down the dead connection and is lost (a
        # real client's deadline and retry cover that): ask once it has reconnected.
        next_event(monitor, zmq.EVENT_DISCONNECTED)
        next_event(monitor, zmq.EVENT_HANDSHAKE_SUCCEEDED)
        assert request(huge, {"op": "hello"})["ok"]  # it reconnected
        huge.disable_monitor()
        monitor.close(linger=0)
