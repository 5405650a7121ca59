"""Malformed messages and hostile manifests get error replies; the registry process keeps serving."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from refitflow.core.columns import FIELDS
from refitflow.core.wire import PROTOCOL_VERSION
from tests.registry._procs import spawn_registry, stop, sync_dealer

NO_TILES = ["xxh3", 0, 0, ""]  # digest algorithm, tile rows, tile columns, base64 digests (none: one digest)
VALID_SHARD = ["w", "float32", [8, 3], 0, 0, 4, "0123456789abcdef", 0, 0, *NO_TILES]


def columns(rows: list[list[Any]]) -> dict[str, Any]:
    """Shard rows (the field order of ``core.columns.FIELDS``) in the wire's column form."""
    return {"count": len(rows), "same": {}, "each": {f: [r[i] for r in rows] for i, f in enumerate(FIELDS[:13])}}


def manifest(rank: int = 0, shards: Any = None, **over: Any) -> dict[str, Any]:
    return {
        "format": PROTOCOL_VERSION,
        "identity": {"model": "hostile"}, "version": 1, "rank": rank, "world_size": 2, "revision": "",
        "metadata": {}, "source": {"transport": "loopback", "agent": "a", "metadata": ""},
        "shards": columns([VALID_SHARD] if shards is None else shards), **over,
    }  # fmt: skip


@pytest.fixture(scope="module")
def registry_address() -> Iterator[str]:
    async def start() -> tuple[Any, str]:
        return await spawn_registry("--lease-s", "30")

    loop = asyncio.new_event_loop()
    proc, address = loop.run_until_complete(asyncio.wait_for(start(), 30))
    yield address
    loop.run_until_complete(stop(proc))
    loop.close()
    assert proc.returncode in (-9, 0), "the registry process died before the end of the tests"


@pytest.fixture(scope="module")
def dealer(registry_address: str) -> Iterator[zmq.Socket[bytes]]:
    with sync_dealer(registry_address) as sock:
        yield sock


def ask(sock: zmq.Socket[bytes], *frames: bytes) -> dict[str, Any]:
    sock.send_multipart(list(frames))
    return dict(orjson.loads(sock.recv()))  # zmq.Again (a failure) if the registry does not answer in 5 s


def request(sock: zmq.Socket[bytes], op: str, **args: Any) -> dict[str, Any]:
    return ask(sock, orjson.dumps({"v": PROTOCOL_VERSION, "id": 7, "op": op, **args}))


@pytest.mark.parametrize(
    ("frame", "error"),
    [
        (b"{not json", "ManifestError"),
        (b"[1, 2, 3]", "ManifestError"),
        (orjson.dumps({"v": 999, "id": 1, "op": "hello"}), "ManifestError"),
        (orjson.dumps({"v": PROTOCOL_VERSION, "id": 1, "op": "no_such_op"}), "ManifestError"),
        (orjson.dumps({"v": PROTOCOL_VERSION, "id": 1, "op": "latest"}), "ManifestError"),
        (orjson.dumps({"v": PROTOCOL_VERSION, "id": 1, "op": "latest", "identity": {"model": 3}}), "ManifestError"),
        (orjson.dumps({"v": PROTOCOL_VERSION, "id": 1, "op": "publish", "manifest": "x"}), "ManifestError"),
        (
            orjson.dumps(
                {
                    "v": PROTOCOL_VERSION,
                    "id": 1,
                    "op": "is_released",
                    "identity": {"model": "m"},
                    "version": 1,
                    "policy": {"receivers": -1},
                }
            ),
            "ConfigError",
        ),
    ],
)
def test_malformed_message_gets_a_named_error(dealer: zmq.Socket[bytes], frame: bytes, error: str) -> None:
    reply = ask(dealer, frame)
    assert reply["ok"] is False and reply["error"] == error and reply["message"]
    assert request(dealer, "hello")["ok"]


def test_an_old_peer_and_an_old_manifest_are_refused_with_a_clear_error(dealer: zmq.Socket[bytes]) -> None:
    old = manifest(0)
    del old["format"]
    old["shards"] = [VALID_SHARD[:9]]  # what protocol 1 sent: no digest algorithm, no tiles
    reply = ask(dealer, orjson.dumps({"v": 1, "id": 3, "op": "publish", "manifest": old}))
    assert (
        reply["error"] == "ManifestError"
        and f"protocol version 1 not supported (we speak {PROTOCOL_VERSION})" in (reply["message"])
    )
    reply = request(dealer, "publish", owner="hostile", manifest=old)  # today's envelope around a format-1 manifest
    assert reply["error"] == "ManifestError" and "manifest format 1 is not supported" in reply["message"]


def test_extra_frames_get_a_typed_answer_and_the_registry_keeps_serving(dealer: zmq.Socket[bytes]) -> None:
    reply = ask(dealer, b"a", b"b", b"c")
    assert reply["ok"] is False and reply["error"] == "ManifestError" and "one frame" in reply["message"]
    assert request(dealer, "hello")["ok"]


def test_overlapping_and_disagreeing_ranks_are_refused_by_name(dealer: zmq.Socket[bytes]) -> None:
    assert request(dealer, "publish", owner="hostile", manifest=manifest(0))["ok"]
    overlap = request(
        dealer,
        "publish",
        owner="hostile",
        manifest=manifest(1, [["w", "float32", [8, 3], 0, 2, 6, "0" * 16, 0, 0, *NO_TILES]]),
    )
    assert overlap["error"] == "ManifestError" and "overlaps" in overlap["message"] and overlap["tensor"] == "w"
    shape = request(
        dealer,
        "publish",
        owner="hostile",
        manifest=manifest(1, [["w", "float32", [9, 3], 0, 4, 8, "0" * 16, 0, 0, *NO_TILES]]),
    )
    assert shape["error"] == "ManifestError" and "global_shape" in shape["message"]
    dtype = request(
        dealer,
        "publish",
        owner="hostile",
        manifest=manifest(1, [["w", "bfloat16", [8, 3], 0, 4, 8, "0" * 16, 0, 0, *NO_TILES]]),
    )
    assert dtype["error"] == "ManifestError" and "dtype" in dtype["message"]
    other = request(
        dealer,
        "publish",
        owner="hostile",
        manifest=manifest(0, [["w", "float32", [8, 3], 0, 0, 4, "f" * 16, 0, 0, *NO_TILES]]),
    )
    assert other["error"] == "VersionError"


scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**63 - 1), st.text(max_size=8), st.floats())
junk = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
words = st.sampled_from(["w", "float32", "int8", "bogus", "0123456789abcdef"])
shard = st.lists(st.one_of(words, st.integers(-3, 10), st.lists(st.integers(-1, 10), max_size=3), junk), max_size=10)
hostile = st.fixed_dictionaries({"format": st.one_of(st.just(PROTOCOL_VERSION), junk)}, optional={
    "identity": st.one_of(junk, st.just({"model": "hostile"})), "version": st.one_of(st.integers(-2, 3), junk),
    "rank": st.integers(-1, 3), "world_size": st.one_of(st.integers(-1, 3), junk), "revision": st.text(max_size=4),
    "metadata": junk, "source": st.one_of(junk, st.just({"transport": "t", "agent": "a"})),
    "shards": st.one_of(st.lists(shard, max_size=3), st.lists(shard, min_size=1, max_size=3).map(
        lambda rows: {"count": len(rows), "same": {}, "each": {f: [r[i] if i < len(r) else None for r in rows]
                                                               for i, f in enumerate(FIELDS[:13])}}),
        st.fixed_dictionaries({"count": st.one_of(st.integers(-1, 3), junk)}, optional={
            "same": st.dictionaries(st.sampled_from(FIELDS), st.one_of(words, junk), max_size=15),
            "each": st.dictionaries(st.sampled_from(FIELDS), st.lists(st.one_of(words, junk), max_size=3))})),
})  # fmt: skip


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=hostile, raw=st.binary(max_size=64))
def test_hostile_manifests_never_crash_the_registry(dealer: zmq.Socket[bytes], body: Any, raw: bytes) -> None:
    reply = request(dealer, "publish", owner="hostile", manifest=body)
    assert reply["ok"] or reply["error"] in {"ManifestError", "VersionError"}, reply
    assert ask(dealer, raw)["ok"] is False
    assert request(dealer, "hello")["ok"]


def test_the_registry_process_outlived_everything(registry_address: str) -> None:
    code = f"import zmq; s=zmq.Context().socket(zmq.DEALER); s.connect({registry_address!r}); s.send(b'x'); s.recv()"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=20)
