"""ckptfmt.StepTimer: per-rank step records (spec 9.4), stored by the save that follows them."""

from __future__ import annotations

import time

import blake3
import numpy as np
import pytest
import torch

import ckptfmt
from ckptfmt.metadata.step_timer import decode_steps


def run_steps(timer: ckptfmt.StepTimer, steps, *, sleep_in: dict | None = None) -> np.ndarray:
    """Steps with data/forward phases (and backward from step 2 on), a batch and a loss each.
    Returns each step's time as measured around it (on the timer's clock)."""
    around = []
    for step in steps:
        before = time.perf_counter_ns()
        with timer.step(step):
            timer.batch(torch.arange(step * 8, step * 8 + 8))
            with timer.phase("data"):
                time.sleep((sleep_in or {}).get(step, 0))
            with timer.phase("forward"):
                pass
            if step >= 2:
                with timer.phase("backward"):
                    pass
        around.append((time.perf_counter_ns() - before) / 1e9)
        timer.metrics(loss=10.0 - step)
    return np.array(around)


def steps_of(url: str, rank: int = 0):
    with ckptfmt.open(url) as reader:
        return decode_steps(reader.metadata["timing"]["ranks"][rank]["steps"], url)


def taken(timer: ckptfmt.StepTimer):
    return decode_steps(timer.snapshot(), "the timer")


def test_steps_are_recorded_in_columns():
    timer = ckptfmt.StepTimer()
    before = time.time_ns()
    around = run_steps(timer, range(4), sleep_in={1: 0.02})
    after = time.time_ns()
    columns = taken(timer)
    assert columns.count == 4 and columns.step.tolist() == [0, 1, 2, 3] and len(timer) == 4
    assert columns.phases["data"][1] >= 0.02
    assert np.isnan(columns.phases["backward"][:2]).all()  # a phase first met at step 2
    # each step's time, and its phases', lie within that step as the loop measured it (the sleep in
    # step 1 counted at step 0 would exceed step 0's time)
    assert (columns.phases["data"] <= columns.duration_s).all() and (columns.duration_s <= around).all()
    assert columns.metrics["loss"].tolist() == [10.0, 9.0, 8.0, 7.0] and columns.metrics_missing == {}
    expected = blake3.blake3(np.arange(8, 16, dtype="<i8").tobytes()).digest(16)
    assert columns.batch[1].tobytes() == expected and columns.batch_size.tolist() == [8, 8, 8, 8]
    starts = columns.start_ns.tolist()
    assert starts == sorted(starts) and before <= starts[0] and starts[-1] <= after


def test_time_in_phases_of_one_name_adds_up_and_batches_digest_together():
    timer = ckptfmt.StepTimer()
    with timer.step(0):
        for _ in range(2):
            with timer.phase("data"):
                time.sleep(0.01)
        timer.batch([1, 2])
        timer.batch(np.array([3], dtype=np.int32))
    with timer.step(1):  # no batch, and a metric the first step lacks
        timer.metrics(lr=0.1)
    columns = taken(timer)
    assert columns.phases["data"][0] >= 0.02
    assert columns.batch[0].tobytes() == blake3.blake3(np.array([1, 2, 3], dtype="<i8").tobytes()).digest(16)
    assert columns.batch_size.tolist() == [3, -1] and not columns.batch[1].any()
    assert columns.metrics_missing["lr"].tolist() == [True, False] and columns.metrics["lr"][1] == 0.1


@pytest.mark.parametrize(("call", "message"), [
    (lambda t: t.phase("data").__enter__(), "outside a step"),
    (lambda t: t.batch([1]), "outside a step"),
    (lambda t: t.metrics(loss=1.0), "no step"),
    (lambda t: t.step("three"), "an int"),
])
def test_misuse_gets_a_clear_error(call, message):
    with pytest.raises(ValueError, match=message):
        call(ckptfmt.StepTimer())


def test_bad_batches_and_metrics_and_nested_steps_are_refused():
    timer = ckptfmt.StepTimer()
    with timer.step(0):
        with pytest.raises(ValueError, match="integer indices"):
            timer.batch(torch.rand(3))
        with pytest.raises(ValueError, match="integer indices"):
            timer.batch(["a", "b"])
        with pytest.raises(ValueError, match="a number is needed"):
            timer.metrics(loss="low")
        with pytest.raises(ValueError, match="do not nest"):
            timer.step(1)


def test_each_checkpoint_stores_the_steps_since_the_previous_one(tmp_path):
    timer = ckptfmt.StepTimer()
    state = {"w": torch.ones(10)}
    run_steps(timer, range(0, 3))
    first = ckptfmt.save(state, tmp_path / "repo" / "a", step=2, timer=timer)
    run_steps(timer, range(3, 5))
    second = ckptfmt.save(state, tmp_path / "repo" / "b", step=4, timer=timer)
    assert steps_of(first).step.tolist() == [0, 1, 2]
    assert steps_of(second).step.tolist() == [3, 4] and steps_of(second).metrics["loss"].tolist() == [7.0, 6.0]
    assert len(timer) == 0


def test_a_failed_save_keeps_the_steps_for_the_next_one(tmp_path):
    timer = ckptfmt.StepTimer()
    state = {"w": torch.ones(10)}
    ckptfmt.save(state, tmp_path / "repo" / "a")
    run_steps(timer, range(3))
    with pytest.raises(ckptfmt.CheckpointExistsError):
        ckptfmt.save(state, tmp_path / "repo" / "a", timer=timer)
    assert len(timer) == 3
    url = ckptfmt.save(state, tmp_path / "repo" / "b", timer=timer)
    assert steps_of(url).step.tolist() == [0, 1, 2]


def test_an_async_save_stores_the_steps_up_to_its_call(tmp_path):
    timer = ckptfmt.StepTimer()
    state = {"w": torch.ones(1000)}
    run_steps(timer, range(3))
    future = ckptfmt.async_save(state, tmp_path / "repo" / "a", timer=timer)
    run_steps(timer, range(3, 6))  # while it saves
    url = future.result(timeout=60)
    assert steps_of(url).step.tolist() == [0, 1, 2]
    assert taken(timer).step.tolist() == [3, 4, 5]  # the stored ones left the timer before result() returned


@pytest.mark.parametrize(("change", "message"), [
    (lambda r: r.update(count=-1), "count"),
    (lambda r: r.update(step=r["step"][:-1]), "step is not 3 int64 values"),
    (lambda r: r.update(batch=[1, 2]), "batch is not 48 uint8 values"),
    (lambda r: r["phases"].update(data="fast"), "phases.data is not 3 float64"),
    (lambda r: r.update(metrics=[1.0]), "metrics is not a map"),
])
def test_a_damaged_step_record_is_refused_naming_the_column(change, message):
    timer = ckptfmt.StepTimer()
    run_steps(timer, range(3))
    record = timer.snapshot()
    change(record)
    with pytest.raises(ckptfmt.ManifestError, match=message):
        decode_steps(record, "step-3 rank 0")


def test_save_refuses_something_else_as_timer(tmp_path):
    with pytest.raises(TypeError, match="StepTimer"):
        ckptfmt.save({"w": torch.ones(1)}, tmp_path / "repo" / "a", timer={"steps": []})


# -- the API for frameworks' hooks ------------------------------------------------------------------
def test_hooks_record_a_step_whose_first_phase_began_before_the_hook_ran():
    """A framework calls start_step after fetching the batch: since_ns dates the step and its data
    phase back to when the fetch began; mark() moves from phase to phase; end_step() closes both."""
    timer = ckptfmt.StepTimer()
    fetch_began = time.perf_counter_ns()
    wall_before = time.time_ns()
    time.sleep(0.02)  # the fetch, before any hook ran
    timer.start_step(7, since_ns=fetch_began, phase="data")
    assert timer.in_step
    time.sleep(0.01)
    timer.mark("forward_backward")
    time.sleep(0.01)
    timer.mark("optimizer")
    timer.end_step()
    ended = time.perf_counter_ns()
    assert not timer.in_step
    columns = decode_steps(timer.snapshot(), "timer")
    assert columns.step.tolist() == [7]
    assert wall_before - 1e6 <= columns.start_ns[0] <= wall_before + 1e7  # dated back to the fetch
    duration = columns.duration_s[0]
    assert 0.04 <= duration <= (ended - fetch_began) / 1e9
    phases = {name: values[0] for name, values in columns.phases.items()}
    assert set(phases) == {"data", "forward_backward", "optimizer"}
    assert phases["data"] >= 0.03 and phases["forward_backward"] >= 0.01
    assert sum(phases.values()) == pytest.approx(duration, abs=1e-6)  # every moment in exactly one phase


def test_hook_phases_add_up_with_context_phases_of_the_same_name():
    timer = ckptfmt.StepTimer()
    timer.start_step(0, phase="data")
    timer.mark(None)
    with timer.phase("data"):
        time.sleep(0.005)
    timer.end_step()
    data = decode_steps(timer.snapshot(), "timer").phases["data"][0]
    assert data >= 0.005


@pytest.mark.parametrize("call, message", [
    (lambda t: t.mark("x"), r"outside a step: call start_step first"),
    (lambda t: t.end_step(), r"with no step started"),
    (lambda t: (t.start_step(1), t.start_step(2)), r"start_step\(2\) inside step 1: end it first"),
])
def test_hook_misuse_gets_a_clear_error(call, message):
    with pytest.raises(ValueError, match=message):
        call(ckptfmt.StepTimer())
