"""The registry process pauses the cyclic collector while it handles large requests, then freezes what they
left; it never leaves the collector off, and a process that is not the registry's own is left alone."""

from __future__ import annotations

import gc

from refitflow.registry.service.gc_pause import GcPause


def test_the_collector_is_off_while_any_large_request_is_handled_and_on_after() -> None:
    pause = GcPause(enabled=True)
    frozen = gc.get_freeze_count()
    try:
        with pause.during(large=True):
            assert not gc.isenabled()
            with pause.during(large=True):  # two large requests at once
                pass
            assert not gc.isenabled()  # the first is still being handled
            held = [[i] for i in range(1000)]  # what the request leaves held
        assert gc.isenabled() and gc.get_freeze_count() >= frozen + len(held)
        with pause.during(large=False):
            assert gc.isenabled()
    finally:
        gc.unfreeze()
        gc.enable()


def test_a_process_not_the_registrys_own_keeps_its_collector() -> None:
    with GcPause(enabled=False).during(large=True):
        assert gc.isenabled()


def test_an_error_while_handling_turns_the_collector_back_on() -> None:
    pause = GcPause(enabled=True)
    try:
        try:
            with pause.during(large=True):
                raise ValueError("a bad frame")
        except ValueError:
            pass
        assert gc.isenabled()
    finally:
        gc.unfreeze()
        gc.enable()
