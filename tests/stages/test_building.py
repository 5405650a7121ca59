"""``building()``: while a worker thread builds plan structures the collector is paused and the switch
interval is short; both are restored when the last builder (of any thread) leaves."""

from __future__ import annotations

import gc
import sys
import threading

import pytest

from refitflow.core.gil import building, built


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
