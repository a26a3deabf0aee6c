"""Pausing the cyclic garbage collector: overlapping pauses in several threads leave it as they found it."""

from __future__ import annotations

import gc
import sys
import threading

from ckptfmt._collector import collector_paused


def test_overlapping_pauses_in_threads_turn_the_collector_back_on():
    """Each thread checking and restoring on its own left it off for good (seen with 8 threads, switching
    threads as often as the interpreter allows: 2 of 5 runs of the former code)."""
    assert gc.isenabled()
    start = threading.Barrier(8)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)

    def pause_often() -> None:
        start.wait()
        for _ in range(2000):
            with collector_paused(), collector_paused():  # nested, as a manifest parsed inside a save
                pass

    threads = [threading.Thread(target=pause_often) for _ in range(8)]
    for thread in threads:
        thread.start()
    try:
        for thread in threads:
            thread.join(timeout=60)
    finally:
        sys.setswitchinterval(interval)
    assert gc.isenabled()


def test_a_collector_the_caller_turned_off_stays_off():
    gc.disable()
    try:
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_the_collector_is_off_inside_and_on_after_an_error():
    try:
        with collector_paused():
            assert not gc.isenabled()
            raise KeyError("boom")
    except KeyError:
        pass
    assert gc.isenabled()
