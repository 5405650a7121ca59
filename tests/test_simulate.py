"""``bench/simulate.py``: the link model shares fairly, a lone read takes bytes / bandwidth, relays keep the
trainer's egress at one copy while pipelining, a window of buckets in flight overlaps the serial costs with the
bytes, an FP8 publication is planned by refitflow's planner (values and scales copied), and the CLI runs end to
end on a tiny scenario. The calibration runs real processes for minutes: it is a bench command
(``python bench/simulate.py --scenario calib``), not a test; its parsing of the bench scripts' output is."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import _sim_calib  # noqa: E402
from _sim_model import TODAY, Params, Result, simulate  # noqa: E402
from _sim_net import Activity, Net  # noqa: E402
from _sim_setups import _vllm, flat, megatron_publication  # noqa: E402
from _sim_traffic import Setup, limits_for, plan_classes, upstreams  # noqa: E402

from refitflow.layouts import ModelDims  # noqa: E402
from refitflow.planner import build_plan  # noqa: E402

GB = 1e9
IDEAL = Params(  # one link, nothing else: no latency, no per-bucket or registry costs, instant digests
    gpu_gbps=1.0, latency_us=0.0, bucket_us=0.0, relay_bucket_us=0.0, read_us=0.0, poll_floor_ms=0.0,
    device_verify_gbps=1e6, registry_rtt_ms=0.0, commit_ms=0.0, fixed_ms=0.0, relay_push=True,
)  # fmt: skip


def _run(receivers: int, relay: bool, p: Params, tensors: int = 16, numel: int = 250_000) -> tuple[Result, int]:
    setup = flat(tensors, numel, receivers, name=f"test{tensors}-{numel}")
    cls = plan_classes(setup, relay, log=lambda s: None)
    res = simulate(cls, p, registry_s=0.0, fetch_s=0.0, wire_bytes=0, engines=receivers, relay=relay)
    return res, setup.pub.nbytes


def test_max_min_fair_sharing_of_one_link_then_the_leftover() -> None:
    net, ends = Net(), {}
    link = net.resource("link", 10.0)
    net.start(Activity(10.0, ((link, 1.0),), lambda t: ends.__setitem__("a", t)))
    net.start(Activity(20.0, ((link, 1.0),), lambda t: ends.__setitem__("b", t)))
    net.run()
    assert ends["a"] == pytest.approx(2.0)  # 5 units/s each while both run
    assert ends["b"] == pytest.approx(3.0)  # then 10 units/s for the 10 left


def test_max_min_fair_gives_the_unshared_flow_what_the_bottleneck_leaves() -> None:
    net = Net()
    wide, narrow = net.resource("wide", 10.0), net.resource("narrow", 4.0)
    f1 = Activity(100.0, ((wide, 1.0),), lambda t: None)
    f2 = Activity(100.0, ((wide, 1.0), (narrow, 1.0)), lambda t: None)
    f3 = Activity(100.0, ((narrow, 1.0),), lambda t: None)
    for f in (f1, f2, f3):
        net.start(f)
    net._share()
    assert (f1.rate, f2.rate, f3.rate) == pytest.approx((8.0, 2.0, 2.0))


def test_a_lone_receiver_takes_its_bytes_over_the_link_plus_the_fixed_cost() -> None:
    res, nbytes = _run(1, False, dataclasses.replace(IDEAL, fixed_ms=7.0))
    assert res.committed == pytest.approx(nbytes / GB + 7e-3, rel=0.01)
    assert res.trainer_egress == nbytes


def test_relayed_receivers_started_together_cost_one_copy_and_about_the_lone_time() -> None:
    lone, nbytes = _run(1, True, IDEAL, tensors=64)  # 16 buckets of 4 MiB (relay_bucket_bytes)
    four, _ = _run(4, True, IDEAL, tensors=64)
    assert four.trainer_egress == pytest.approx(nbytes)  # one model copy however many
    assert four.relay_egress_max == pytest.approx(nbytes)  # each relay passes it on once
    assert four.committed < 1.3 * lone.committed  # a chain, pipelined: each hop lags by about one bucket
    assert four.committed > lone.committed  # ... but it does lag


def test_without_relays_the_trainer_sends_k_copies_and_its_nic_makes_it_k_times_longer() -> None:
    lone, nbytes = _run(1, False, IDEAL)
    four, _ = _run(4, False, IDEAL)
    assert four.trainer_egress == pytest.approx(4 * nbytes)
    assert four.committed == pytest.approx(4 * lone.committed, rel=0.02)
    unlimited, _ = _run(4, False, dataclasses.replace(IDEAL, egress_limit=False))  # readers' own NICs only
    assert unlimited.committed == pytest.approx(lone.committed, rel=0.02)


def test_a_window_of_buckets_overlaps_their_serial_costs_with_their_bytes() -> None:
    # a lone relaying receiver: 256 MB in buckets of 4 MiB (relay_bucket_bytes), each 4.2 ms on the link
    costly = dataclasses.replace(IDEAL, bucket_us=2000.0)  # and 2 ms of serial costs each
    one, nbytes = _run(1, True, dataclasses.replace(costly, window=1), tensors=64, numel=1_000_000)
    many, _ = _run(1, True, costly, tensors=64, numel=1_000_000)
    serial = sum(one.bounds[k] for k in one.bounds if k.startswith("serial:"))
    assert serial > 0.05  # the costs are there to overlap
    assert one.committed == pytest.approx(nbytes / GB + serial, rel=0.05)  # one bucket in flight: they add up
    assert many.committed < one.committed - 0.8 * serial  # a window: the link hides them
    assert many.committed >= nbytes / GB  # ... and never beats the link


def test_relay_progress_pushed_is_noticed_sooner_than_polled() -> None:
    costly = dataclasses.replace(IDEAL, poll_floor_ms=1.0, bucket_us=100.0)
    assert not Params().relay_push  # the default is what the code does: a reader close behind polls
    pushed, _ = _run(4, True, costly, tensors=64)
    polled, _ = _run(4, True, dataclasses.replace(costly, relay_push=False), tensors=64)
    assert pushed.committed < polled.committed


def test_on_a_cpu_bound_host_upkeep_grows_with_the_receivers_and_a_readers_only_where_it_reads_a_relay() -> None:
    """The calibration box's terms: ``cpu_ms`` is CPU on the host's cores (shared by every receiver there), not a
    latency; ``reader_cpu_ms`` is paid by receivers that read a relay — none when the lone relay reads the trainer."""
    box = dataclasses.replace(IDEAL, host_cores=1.0, cpu_copies=True, gpus_per_host=64, egress_limit=False)
    one, _ = _run(1, False, box)
    eight, _ = _run(8, False, box)
    one_up, _ = _run(1, False, dataclasses.replace(box, cpu_ms=10.0))
    eight_up, _ = _run(8, False, dataclasses.replace(box, cpu_ms=10.0))
    assert one_up.slowest_found_to_prepared == pytest.approx(one.slowest_found_to_prepared + 0.010, rel=0.05)
    assert eight_up.slowest_found_to_prepared == pytest.approx(eight.slowest_found_to_prepared + 0.080, rel=0.05)
    lone, _ = _run(1, True, box)
    lone_reader, _ = _run(1, True, dataclasses.replace(box, reader_cpu_ms=10.0))
    chain, _ = _run(4, True, box)
    chain_reader, _ = _run(4, True, dataclasses.replace(box, reader_cpu_ms=10.0))
    assert lone_reader.slowest_found_to_prepared == pytest.approx(lone.slowest_found_to_prepared)
    assert chain_reader.slowest_found_to_prepared > chain.slowest_found_to_prepared + 0.010


def _tiny_moe(fp8: bool) -> Setup:
    """A Kimi-K2-shaped MoE small enough for CI: MLA, a dense layer, 4 experts; trainer TP 2 × EP 2, receivers
    vLLM TP 2 with EP; every linear slice on the 128 × 128 block grid."""
    d = ModelDims(vocab=1024, hidden=512, layers=2, heads=4, kv_heads=4, head_dim=128, ffn=1024, dense_layers=1,
                  experts=4, expert_ffn=256, shared_ffn=256, router_bias=True, q_lora_rank=256, kv_lora_rank=128,
                  rope_dim=64, v_head_dim=128)  # fmt: skip
    pub = megatron_publication(d, "tiny", tp=2, ep=2, pp=1, pp_layers=(2,), fp8=fp8)
    return Setup("tiny-fp8" if fp8 else "tiny", pub, 2, 2, _vllm(d, 2, True, fp8))  # type: ignore[arg-type]


def test_an_fp8_publication_is_planned_by_the_planner_values_and_scales_copied() -> None:
    bf16, fp8 = _tiny_moe(False), _tiny_moe(True)
    quant = [m.metadata.get("quant") for m in fp8.pub.manifests]
    assert all(q and "fp8_block128" in q for q in quant)  # announced as the publisher announces it
    assert not any("quant" in m.metadata for m in bf16.pub.manifests)
    plans = {s.name: build_plan(s.pub, s.landing(1), limits_for(False)) for s in (bf16, fp8)}
    dest = fp8.landing(1)
    assert dest.quantised  # the receiver holds FP8 parameters with their scales...
    assert not plans["tiny-fp8"].route.converted  # ... every one copied as published, none converted
    read = {n: pl.nbytes for n, pl in plans.items()}
    assert 0.5 * read["tiny"] < read["tiny-fp8"] < 0.75 * read["tiny"]  # half the linear bytes, plus scales


def test_a_slice_that_cuts_blocks_is_held_in_bf16_and_converted() -> None:
    d = ModelDims(vocab=1024, hidden=512, layers=1, heads=4, kv_heads=4, head_dim=128, ffn=1152, q_lora_rank=256,
                  kv_lora_rank=128, rope_dim=64, v_head_dim=128)  # fmt: skip  # 1152 / 2 = 576: cuts a block
    pub = megatron_publication(d, "cut", tp=1, ep=1, pp=1, pp_layers=(1,), fp8=True)
    plan = build_plan(pub, _vllm(d, 2, False, True)(0), limits_for(False))  # type: ignore[operator]
    assert {n.rsplit(".", 2)[-2] for n in plan.route.converted} == {"gate_up_proj", "down_proj"}


def test_the_calibration_reads_the_bench_scripts_output(monkeypatch: pytest.MonkeyPatch) -> None:
    fanout = "\n".join(["model 64.0 MB in 64 tensors; 8 receiver processes", "together egress (copies) relayed MB",
                         *(f"{k:>8} {1.0:>15.2f} {0.0:>10.1f} {0.01:>7.3f} {0.02 * k:>7.3f} {1.0:>10.2f} "
                           f"{20.0 + k:>17.1f}" for k in _sim_calib.TOGETHER), "load average after: 1.00"])  # fmt: skip
    cost = ("64 fp32 tensors, 67.1 MB, mode in_place\n\n| buckets (refit) | reads (raw) |\n|---:|---:|\n"
            "| 5 | 4 | 0.0310 | 0.0129 | 0.0120 | 2.17 |\n| 91 | 64 | 0.0933 | 0.0549 | 0.0300 | 0.72 |\n"
            "\nper bucket: refit 700 us; raw reads one at a time 500 us, windowed 300 us; refitflow's own 400 us "
            "(refit - raw windowed)\n")  # fmt: skip
    relay = ("2048 fp32 tensors, 64 MiB, strict verify\n\n| buckets | from the trainer, best s | from the relay, "
             "best s |\n|---:|---:|---:|\n| 4 | 0.0300 | 0.0310 |\n\nper bucket: from the trainer 124 us, from the "
             "relay 147 us; a relayed bucket's own 23 us (slopes of the best times over bucket count); a status read's "
             "CPU 127 us (every thread of this process)\n")  # fmt: skip
    outputs = {"fanout_bench.py": fanout, "bucket_cost.py": cost, "relay_cost.py": relay}
    monkeypatch.setattr(_sim_calib, "_run", lambda args, timeout=600: outputs[pathlib.Path(args[0]).name])
    rows = _sim_calib.fanout(True)
    assert [r[1] for r in rows] == pytest.approx([0.02 * k for k in _sim_calib.TOGETHER])
    assert [r[3] for r in rows] == pytest.approx([20.0 + k for k in _sim_calib.TOGETHER])  # CPU ms a receiver
    assert _sim_calib.relay_cost() == (23.0, 127.0)
    got = _sim_calib.bucket_cost()
    assert (got["refit_us"], got["raw_us"], got["win_us"], got["own_us"]) == (700.0, 500.0, 300.0, 400.0)
    assert got["copy_gbps"] == pytest.approx(67.1e6 / (0.0129 - 4 * 0.0007) / 1e9, rel=1e-6)


def test_the_data_path_before_issue_51_is_one_bucket_in_flight() -> None:
    assert TODAY["window"] == 1 and Params().window >= 4  # the default is issue 51's window


def test_a_receiver_fetches_per_version_the_digests_its_checks_read() -> None:
    setup = flat(16, 250_000, 2, name="test-part")
    cls = plan_classes(setup, False, log=lambda s: None)
    every = sum(s.tiling.count for m in setup.pub.manifests for s in m.shards)
    assert all(0 < p.part_digests <= every for p in cls.plans)  # its plan's part (here: all it reads)
    assert cls.part_digests == max(p.part_digests for p in cls.plans)


def test_the_registry_scheduler_chains_receivers_in_join_order() -> None:
    cls = plan_classes(flat(16, 250_000, 4, name="test"), True, log=lambda s: None)
    ups = upstreams(cls.plans, 4, True)
    assert [ups[(e, 0)] for e in range(4)] == [None, (0, 0), (1, 0), (2, 0)]


def test_the_cli_prints_a_table_for_a_tiny_scenario(tmp_path: pathlib.Path) -> None:
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, str(ROOT / "bench" / "simulate.py"), "--scenario", "flat", "--receivers", "3",
           "--tensors", "8", "--numel", "100000", "--cache", str(tmp_path), "--drivers"]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    for mode in ("relay", "no relay"):
        assert f"| as built (plan cached) | {mode} |" in done.stdout
        assert f"| before issue 51 (window 1, host digests, polled relays) | {mode} |" in done.stdout
        assert f"| refitflow's cost per bucket (bucket_us 0) | {mode} |" in done.stdout
        assert f"| control plane: the registry's work on the records, each receiver's part fetched and decoded (0) " \
               f"| {mode} |" in done.stdout  # fmt: skip
    assert "per version a receiver fetches" in done.stdout  # its plan's part, not the publication
    assert list(tmp_path.glob("flat-3x1-relay-*.pkl"))  # the planned classes were cached


def test_receivers_that_read_early_wait_for_the_pending_records_alone_and_verify_after_the_complete_ones() -> None:
    """Announced before its digests (the publisher's auto mode when every byte changed), a version is read once
    the registry took the records without digests (``pending_s``); the complete records' work (``registry_s``)
    overlaps the reads. A relay serves verified bytes: it waits for the complete version either way."""
    setup = flat(256, 250_000, 1, name="test-early")  # 256 MB: segments of several buckets
    p = dataclasses.replace(IDEAL, gpu_gbps=setup.pub.nbytes / 0.5 / GB)  # its reads take 0.5 s
    for relay in (False, True):
        cls = plan_classes(setup, relay, log=lambda s: None)

        def took(pending: float | None, cls=cls, relay=relay) -> float:
            return simulate(cls, p, registry_s=1.0, fetch_s=0.0, wire_bytes=0, engines=1, relay=relay,
                            pending_s=pending).committed  # fmt: skip

        if relay:
            assert took(0.0) == pytest.approx(took(None)) == pytest.approx(took(1.0))
        else:
            assert took(None) == pytest.approx(1.5, rel=0.02)  # the pending phase costs as much, then the reads
            # every byte read and hashed while the complete records are checked; compared once they are in
            assert took(0.0) == pytest.approx(1.0, rel=0.02)
