"""The stream between real processes over a real gloo group: a sender (rank 0) and two receivers
(ranks 1 in place, 2 shadow) that form one engine and vote over a gloo group of their own."""

from __future__ import annotations

import multiprocessing as mp
from typing import Any

import pytest

from tests.conftest import free_ports
from tests.push import stream_worker
from tests.push._frames import CASES

Script = list[tuple[str, int]]


def run_stream(script: Script, opts: dict | None = None) -> dict[int, list[dict[str, Any]]]:
    """Start the three processes, walk the script, return each rank's reports; fail if one hangs."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    ports = tuple(free_ports(2))  # distinct: two ports taken one after the other may be the same one
    procs = [ctx.Process(target=stream_worker.run, args=(r, ports, script, opts or {}, queue)) for r in range(3)]
    for p in procs:
        p.start()
    try:
        reports = dict(queue.get(timeout=240) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.exitcode is None:
                p.kill()
    assert all(p.exitcode == 0 for p in procs), "a process hung or crashed"
    crashes = [r[0]["crash"] for r in reports.values() if r and "crash" in r[0]]
    assert not crashes, crashes[0]
    return reports


def _script() -> Script:
    steps = ["good", "good", "good", *CASES, "good", "refuse", "good", "fail", "good"]
    return [(kind, version) for version, kind in enumerate(steps, start=1)]


@pytest.fixture(scope="module")
def sequence() -> dict[int, list[dict[str, Any]]]:
    """One group, one long stream of versions: good ones, every malformed case, refusals, failures."""
    return run_stream(_script())


def _steps(reports: dict[int, list[dict]], kind: str) -> list[tuple[dict, dict]]:
    return [(a, b) for a, b in zip(reports[1], reports[2], strict=True) if a["kind"] == kind]


def test_the_sender_finishes_every_stream_of_the_sequence(sequence: dict) -> None:
    assert [s["ok"] for s in sequence[0]] == [True] * len(_script())
    assert len(sequence[1]) == len(sequence[2]) == len(_script())


def test_three_versions_in_a_row_commit_bit_exact_in_place_and_shadow(sequence: dict) -> None:
    for a, b in _steps(sequence, "good")[:3]:
        for r in (a, b):
            assert r["committed"] and r["serves"] == r["version"] and r["fence"] == "ready", r
    assert {sequence[1][0]["mode"], sequence[2][0]["mode"]} == {"in_place", "shadow"}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_malformed_stream_is_refused_with_nothing_applied_and_the_next_commits(sequence: dict, case: str) -> None:
    kind, wrote_first = CASES[case]
    ((a, b),) = _steps(sequence, case)
    for r in (a, b):
        assert not r["committed"] and r["decision"] == "abort", r
        assert r["error"] == "FrameError" and r["error_kind"] == kind and not r["left_group"], r
    before = max(r["version"] for r in sequence[2][: a["version"] - 1] if r["committed"])  # served until now
    assert b["serves"] == before and b["fence"] == "ready"  # shadow: the old version serves untouched
    if wrote_first:  # in place, a refused frame after a written bucket: fenced, never a mix
        assert a["fence"] == "fenced", a
    else:  # in place, nothing written: the rank is as it was before the stream
        assert a["serves"] == before and a["fence"] == "ready", a
    after = sequence[1][a["version"]], sequence[2][a["version"]]  # the next step of the script
    if after[0]["kind"] == "good":
        assert all(r["committed"] and r["serves"] == r["version"] for r in after), after


def test_every_refused_frame_is_counted_by_kind(sequence: dict) -> None:
    last = sequence[1][-1]["refused"]
    kinds = [kind for kind, _ in CASES.values()]
    assert {k: last[k] for k in ("entry", "metadata", "header", "command")} == {
        k: kinds.count(k) for k in ("entry", "metadata", "header", "command")
    }
    assert last["version"] == 0 and last["ceiling"] == 0  # rank 1 never refused a version


def test_a_rank_refusing_the_stream_means_neither_rank_commits(sequence: dict) -> None:
    ((a, b),) = _steps(sequence, "refuse")
    assert not a["committed"] and not b["committed"] and a["decision"] == b["decision"] == "abort"
    assert b["error"] == "VersionError" and a["error"] is None  # rank 1 was ready; the vote aborted it
    assert a["fence"] == "fenced"  # in place, it had written the version: fenced until the next commit
    assert b["fence"] == "fenced" and b["serves"] == b["version"] - 1  # refused while a peer began: fenced too
    following = sequence[1][a["version"]], sequence[2][a["version"]]
    assert all(r["committed"] and r["fence"] == "ready" for r in following), following


def test_a_rank_whose_bucket_fails_keeps_in_step_and_neither_commits(sequence: dict) -> None:
    ((a, b),) = _steps(sequence, "fail")
    assert a["error"] == "RefitError" and "injected apply failure" in a["message"] and not a["left_group"]
    assert not a["committed"] and not b["committed"] and b["serves"] == b["version"] - 1
    final = sequence[1][-1], sequence[2][-1]
    assert all(r["committed"] and r["serves"] == r["version"] for r in final), final


def test_an_oversize_header_puts_every_rank_out_of_step_and_nobody_hangs() -> None:
    reports = run_stream([("good", 1), ("oversize", 2)])
    for rank in (1, 2):
        good, over = reports[rank]
        assert good["committed"] and over["error"] == "OutOfStepError" and over["left_group"], over
        assert "9223372036854775807 payload bytes" in over["message"] and over["refused"]["ceiling"] == 1
        assert over["serves"] == 1 and over["fence"] == "ready"  # refused at the header: nothing begun
    sent = reports[0]
    assert sent[0]["ok"] and sent[1]["error"] == "OutOfStepError", sent  # its next broadcast found nobody


def test_a_payload_buffer_that_cannot_be_allocated_puts_the_rank_out_of_step() -> None:
    reports = run_stream([("good", 1)], {2: 2**50})  # 1 PiB: no address space holds it
    (r2,) = reports[2]
    assert r2["error"] == "OutOfStepError" and "could not allocate" in r2["message"] and r2["left_group"], r2
    (r1,) = reports[1]
    assert not r1["committed"] and r1["decision"] == "abort", r1  # its peer never got ready: nobody commits
    assert reports[0][0]["error"] == "OutOfStepError" and r1["error"] == "OutOfStepError"  # the others left too


def test_hf_names_of_a_llama_land_in_fused_tensor_parallel_shards_across_buckets() -> None:
    reports = run_stream([("llama", 1)])
    for rank in (1, 2):
        (r,) = reports[rank]
        assert r["committed"] and r["exact"], r
        assert (
            "model.layers.0.self_attn.qkv_proj.weight" in r["fused"]
            and "model.layers.0.mlp.gate_up_proj.weight" in r["fused"]
        )
    assert reports[0][0]["ok"]
