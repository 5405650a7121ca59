"""The device seam is called in the right order by the real pipeline (cpu here, cuda on a GPU).

The receiver's own ``DeviceLane`` is wrapped by a recording lane that logs every call and then makes
the real one. On CUDA the recorder first queues a ~25 ms sleep kernel on the refit stream at every
``record``, so a wait that returned early is caught: after each ``wait`` the marks must have
completed, after ``drain`` every refit stream must be idle.
"""

from __future__ import annotations

import itertools
from typing import Any

import anyio
import pytest
import torch

import refitflow as rf
from refitflow.metrics import NullObserver
from refitflow.refit.device import DeviceLane
from tests.conftest import mlp, params, same

SLEEP_CYCLES = 50_000_000  # ≈ 25 ms at 2 GHz


class Tagged(tuple):
    """The marks of one ``record`` call, tagged so the test can follow them to their ``wait``."""

    tag: int


class Log(NullObserver):
    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []
        self._used = 0

    def stage_enter(self, stage: str) -> None:
        self.events.append(("enter", stage))

    def fence_state(self, state: str) -> None:
        self.events.append(("fence", state))

    def budget(self, used_bytes: int, peak_bytes: int, capacity_bytes: int) -> None:
        if used_bytes < self._used:
            self.events.append(("release",))
        self._used = used_bytes


class RecordingLane:
    def __init__(self, lane: DeviceLane, recv: rf.Receiver, log: Log) -> None:
        self.lane, self.recv, self.log = lane, recv, log
        self.devices = lane.devices
        self._tags = itertools.count()

    def use(self, devices: Any) -> Any:
        return self.lane.use(devices)

    def record(self, devices: Any) -> Tagged:
        devices = tuple(devices)
        for d in devices:
            if torch.device(d).type == "cuda":
                with self.lane.use([d]):
                    torch.cuda._sleep(SLEEP_CYCLES)  # slow device work: an early return would show
        marks = Tagged(self.lane.record(devices))
        marks.tag = next(self._tags)
        self.log.events.append(("record", marks.tag))
        return marks

    async def wait(self, marks: tuple[Any, ...]) -> None:
        await self.lane.wait(marks)
        assert all(event.query() for event in marks), "wait returned before the marked work was done"
        self.log.events.append(("wait", getattr(marks, "tag", None)))  # None: a bucket with no device work

    async def drain(self) -> None:
        txn = self.recv.ledger.open
        await self.lane.drain()
        assert all(self.lane.stream(d).query() for d in self.lane.cuda), "drain left work on a refit stream"
        self.log.events.append(("drain", txn.state.value if txn else None))

    async def quiesce(self) -> None:
        txn = self.recv.ledger.open
        self.log.events.append(("quiesce", txn.wrote if txn else None))
        await self.lane.quiesce()


def _lane_events(events: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    return [e for e in events if e[0] in ("record", "wait", "drain", "quiesce")]


@pytest.mark.asyncio
async def test_pipeline_orders_device_work_quiesce_marks_and_drain(ident, registry, device) -> None:
    trainer, server = mlp(1, dtype=torch.bfloat16).to(device), mlp(2).to(device)  # staged and cast: device copies
    log = Log()
    with anyio.fail_after(60):
        async with (
            rf.Publisher(registry, identity=ident) as pub,
            rf.Receiver(server, registry, identity=ident, budget_bytes=8192, observer=log) as recv,
        ):
            recv.devices = RecordingLane(recv.devices, recv, log)  # type: ignore[assignment]
            await pub.publish(1, dict(trainer.named_parameters()))
            result = await recv.refit(1)
    assert same(server, {n: t.float() for n, t in params(trainer).items()})
    ev = log.events
    lane = _lane_events(ev)
    # begin closed the fence, then quiesce ran before a byte was written and before the first pull
    assert lane[0] == ("quiesce", False)
    assert ev.index(("fence", "updating")) < ev.index(lane[0]) < ev.index(("enter", "pull"))
    # one mark per bucket from apply, each waited for (in order) by verify, and every staging release
    # comes after the wait for that bucket's marks
    tags = [e[1] for e in lane if e[0] == "record"]
    assert tags == list(range(result.stages["apply"].items)) and len(tags) > 2
    assert [e[1] for e in lane if e[0] == "wait"] == tags  # buckets in order; pipelined with the next records
    assert all(lane.index(("record", t)) < lane.index(("wait", t)) for t in tags)
    waited = False
    for e in ev:
        if e[0] == "wait":
            waited = True
        elif e[0] == "release":
            assert waited, "staging was released before its bucket's device work was waited for"
            waited = False
    # the last bucket's device work is drained before the transaction is prepared
    assert lane[-1] == ("drain", "open") and [e[0] for e in lane].count("drain") == 1


@pytest.mark.asyncio
async def test_copy_commit_quiesces_copies_and_waits_while_the_fence_is_updating(ident, registry, device) -> None:
    trainer, server = mlp(1).to(device), mlp(2).to(device)
    log = Log()
    with anyio.fail_after(60):
        async with (
            rf.Publisher(registry, identity=ident) as pub,
            rf.Receiver(server, registry, identity=ident, mode="shadow", shadow_commit="copy", observer=log) as recv,
        ):
            recv.devices = RecordingLane(recv.devices, recv, log)  # type: ignore[assignment]
            await pub.publish(1, dict(trainer.named_parameters()))
            txn, _ = await recv.prepare(1)
            start = len(log.events)
            await recv.finish(txn)
    tail = [e for e in log.events[start:] if e[0] != "enter"]
    assert tail[0] == ("fence", "updating") and tail[-1] == ("fence", "ready")
    ((_, tag),) = [e for e in tail if e[0] == "record"]
    assert [e[0] for e in tail[1:-1]] == ["quiesce", "record", "wait"] and tail[-2] == ("wait", tag)
    assert same(server, params(trainer))
