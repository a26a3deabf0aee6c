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


class _Record:
    """A stand-in for a save's records: tracked by the collector, in no cycle."""


def test_what_a_pause_built_is_not_left_for_one_scan_when_it_ends():
    """Records made during a pause go to the oldest generation unscanned: left in the youngest, the first
    allocation after the pause scanned them all at once (a tenth of a second after a save's stage)."""
    scans: list[int] = []

    def seen(phase: str, info: dict) -> None:
        if phase == "start":
            scans.append(info["generation"])

    with collector_paused():
        records = [_Record() for _ in range(50_000)]
        gc.callbacks.append(seen)
    try:
        after = [[] for _ in range(100)]  # allocations that would start the scan
    finally:
        gc.callbacks.remove(seen)
    assert scans == [] and after
    young = {id(o) for generation in (0, 1) for o in gc.get_objects(generation=generation)}
    assert not any(id(record) in young for record in records)
    assert gc.get_freeze_count() == 0 and gc.isenabled()


def test_objects_the_program_froze_stay_frozen():
    """A program that froze its objects (gc.freeze before forking workers) keeps them frozen, none added:
    the pause then leaves its records to the collector as they are. (Checked by identity: the freeze
    count also falls whenever any frozen object of the process dies, a thread's temporary for one.)"""
    kept = [_Record() for _ in range(10)]
    gc.freeze()
    try:
        with collector_paused():
            records = [_Record() for _ in range(1000)]
        seen = {id(o) for o in gc.get_objects()}  # every generation but the permanent one
        assert all(id(record) in seen for record in records)
        assert not any(id(record) in seen for record in kept)
    finally:
        gc.unfreeze()
    assert kept


def test_a_save_waits_with_the_collector_on():
    """The pause is process-wide: a save keeps it to the stages that build records, so an asynchronous
    save's training thread has its collector while the save waits (here, for ``before_commit``)."""
    import tempfile

    import torch

    import ckptfmt

    seen: list[bool] = []
    with tempfile.TemporaryDirectory() as folder:
        ckptfmt.save({"w": torch.ones(3)}, f"{folder}/repo/a", before_commit=lambda: seen.append(gc.isenabled()))
    assert seen == [True]
