"""``building()``: while a worker thread builds plan structures the collector is paused and the switch
interval is short; both are restored when the last builder (of any thread) leaves."""

from __future__ import annotations

import gc
import sys
import threading

import anyio
import pytest

from refitflow.core.threads import building, built, off_loop


def test_the_collector_and_the_switch_interval_come_back_after_nested_builders_of_two_threads() -> None:
    before = sys.getswitchinterval()
    assert gc.isenabled()
    inside, release = threading.Event(), threading.Event()
    seen: list[tuple[bool, float]] = []

    def other() -> None:
        with building():
            inside.set()
            release.wait(10)

    t = threading.Thread(target=other)
    t.start()
    assert inside.wait(10)
    with building():
        with building():
            seen.append((gc.isenabled(), sys.getswitchinterval()))
        seen.append((gc.isenabled(), sys.getswitchinterval()))
    seen.append((gc.isenabled(), sys.getswitchinterval()))  # the other thread still builds
    release.set()
    t.join(10)
    assert all(not enabled and interval <= 0.001 for enabled, interval in seen)
    assert gc.isenabled() and sys.getswitchinterval() == before


def test_a_disabled_collector_stays_disabled_and_a_failing_builder_restores_the_state() -> None:
    before = sys.getswitchinterval()
    gc.disable()
    try:

        def boom() -> None:
            raise ValueError("bad input")

        with pytest.raises(ValueError, match="bad input"):
            built(boom)
        assert not gc.isenabled() and sys.getswitchinterval() == before
    finally:
        gc.enable()
    assert built(lambda a, b: a + b, 2, 3) == 5


@pytest.mark.asyncio
async def test_off_loop_runs_one_builder_at_a_time_off_the_loop_thread_under_building() -> None:
    """Builders hold the GIL: two side by side go no faster, and each is one more thread the event loop
    loses the GIL to, so ``off_loop`` runs them one after the other, in a worker thread."""
    running, most, seen = [0], [0], []
    lock = threading.Lock()

    def builder(k: int) -> int:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        seen.append((threading.current_thread() is threading.main_thread(), gc.isenabled()))
        threading.Event().wait(0.02)  # long enough for the others to start, were they allowed to
        with lock:
            running[0] -= 1
        return k * k

    async with anyio.create_task_group() as tg:
        out: list[int] = []

        async def one(k: int) -> None:
            out.append(await off_loop(builder, k))

        for k in range(4):
            tg.start_soon(one, k)
    assert sorted(out) == [0, 1, 4, 9]
    assert most[0] == 1
    assert seen == [(False, False)] * 4  # a worker thread, the collector paused
    assert gc.isenabled()

    def boom() -> None:
        raise ValueError("bad plan")

    with pytest.raises(ValueError, match="bad plan"):
        await off_loop(boom)
    assert await off_loop(builder, 5) == 25  # a failed builder gave its turn back


def test_what_builders_made_joins_the_oldest_generation_without_a_collection_pass() -> None:
    """The young count grew by every object made while the collector was paused; left so, the first
    allocation after it came back ran a pass over all of them (5–7 ms holding the GIL, at the end of a
    10,000-tensor plan). Now they are promoted without a pass, and nothing the process froze is thawed."""
    assert gc.isenabled() and gc.get_freeze_count() == 0
    passes: list[int] = []

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            passes.append(info["generation"])

    kept: list[list[int]] = []
    gc.callbacks.append(count)
    try:
        with building():
            kept += [[i] for i in range(50_000)]  # tracked objects: a plan's records
            assert gc.get_count()[0] > gc.get_threshold()[0]
        assert gc.get_count()[0] < gc.get_threshold()[0] and gc.get_freeze_count() == 0
        kept += [[i] for i in range(100)]  # allocations after the builder: no pass over the 50,000
        assert passes == []
        gc.collect()
        with building():
            kept += [[i] for i in range(300)]  # a few (a warm refit's verify): left young, collected as usual
        assert gc.get_count()[0] >= 300
        gc.freeze()  # a server that froze its model after loading it
        try:
            before = gc.get_freeze_count()
            with building():
                kept += [[i] for i in range(1000)]
            # not thawed (that leaves none frozen) nor more frozen (that adds the 1,000): a frozen object
            # freed meanwhile by another thread (a test's leftover daemon) lowers the count by one
            assert before - 500 < gc.get_freeze_count() <= before
        finally:
            gc.unfreeze()
    finally:
        gc.callbacks.remove(count)
