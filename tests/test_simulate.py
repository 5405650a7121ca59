"""``bench/simulate.py``: the link model shares fairly, a lone read takes bytes / bandwidth, relays keep the
trainer's egress at one copy while pipelining, and the CLI runs end to end on a tiny scenario."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from _sim_model import Params, Result, simulate  # noqa: E402
from _sim_net import Activity, Net  # noqa: E402
from _sim_setups import flat  # noqa: E402
from _sim_traffic import plan_classes, upstreams  # noqa: E402

GB = 1e9
IDEAL = Params(  # one link, nothing else: no latency, no per-bucket or registry costs, instant digests
    gpu_gbps=1.0, latency_us=0.0, bucket_us=0.0, relay_bucket_us=0.0, read_us=0.0, poll_floor_ms=0.0,
    verify_gbps=1e6, trainer_digest_gbps=1e6, registry_rtt_ms=0.0, commit_ms=0.0, fixed_ms=0.0,
)  # fmt: skip


def _run(receivers: int, relay: bool, p: Params, tensors: int = 16) -> tuple[Result, int]:
    setup = flat(tensors, 250_000, receivers, name=f"test{tensors}")
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


def test_the_registry_scheduler_chains_receivers_in_join_order() -> None:
    cls = plan_classes(flat(16, 250_000, 4, name="test"), True, log=lambda s: None)
    ups = upstreams(cls.plans, 4, True)
    assert [ups[(e, 0)] for e in range(4)] == [None, (0, 0), (1, 0), (2, 0)]


def test_the_cli_prints_a_table_for_a_tiny_scenario(tmp_path: pathlib.Path) -> None:
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, str(ROOT / "bench" / "simulate.py"), "--scenario", "flat", "--receivers", "3",
           "--tensors", "8", "--numel", "100000", "--cache", str(tmp_path)]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    for mode in ("relay", "no relay"):
        assert f"| as built (plan cached) | {mode} |" in done.stdout
    assert list(tmp_path.glob("flat-3x1-relay-*.pkl"))  # the planned classes were cached
