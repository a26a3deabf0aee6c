"""ckptfmt advise: Young's and Daly's checkpoint intervals, the loss model, and advice from real repositories."""

from __future__ import annotations

import argparse
import io
import json
import statistics
import time
from datetime import timedelta

import numpy as np
import pytest
import torch
from rich.console import Console

import ckptfmt
from ckptfmt.cli import advise as advise_cli
from ckptfmt.lifecycle.advise import (
    advise,
    auto_interval,
    daly_interval,
    expected_lost_work,
    expected_overhead,
    rank_split,
    young_interval,
)
from ckptfmt.tools.describe import save_timing

HOUR, DAY = 3600.0, 86400.0


# -- the formulas, against values worked out by hand from the papers' definitions ---------------
def test_young_is_sqrt_of_twice_stall_times_mtbf():
    # 2 * 60 s * 86400 s = 10,368,000 s^2; 3220^2 = 10,368,400, so the root is 3220 - 400 / 6440 = 3219.938 s.
    assert young_interval(60, DAY) == pytest.approx(3219.938, abs=1e-3)
    assert young_interval(8, 100) == pytest.approx(40.0)  # sqrt(1600)


def test_daly_higher_order_estimate():
    # delta = 2, M = 9: delta/2M = 1/9, its root 1/3, sqrt(2 delta M) = 6:
    # 6 * (1 + 1/9 + 1/81) - 2 = 546/81 - 162/81 = 384/81.
    assert daly_interval(2, 9) == pytest.approx(384 / 81)
    # delta = 2, M = 100: delta/2M = 1/100, sqrt(2 delta M) = 20: 20 * (1 + 1/30 + 1/900) - 2 = 16820/900.
    assert daly_interval(2, 100) == pytest.approx(16820 / 900)
    assert daly_interval(10, 5) == 5.0 and daly_interval(10, 5.0) == 5.0  # delta >= 2M: the MTBF itself


def test_daly_equals_young_to_first_order_for_small_stalls():
    # sqrt(2 delta M) * (1/3) sqrt(delta / 2M) = delta / 3, so Daly = Young - 2 delta / 3 + O(delta^1.5 / M^0.5).
    for delta, mtbf in ((1.0, 1e8), (60.0, DAY), (5.0, 8 * HOUR)):
        young, daly = young_interval(delta, mtbf), daly_interval(delta, mtbf)
        assert abs(daly - young) / young < 0.02
        assert young - daly == pytest.approx(2 * delta / 3, rel=0.02)


def test_overhead_and_lost_work_by_hand():
    # Synchronous: delta/tau + (tau + delta)/2M = 10/100 + 110/2000.
    assert expected_overhead(100, 10, 1000) == pytest.approx(0.155)
    assert expected_lost_work(100, 10) == pytest.approx(55.0)
    # Asynchronous, background 20 s within the interval: lost (100 + 1)/2 + 20 = 70.5; overhead 1/100 + 70.5/1000.
    assert expected_lost_work(100, 1, 20) == pytest.approx(70.5)
    assert expected_overhead(100, 1, 1000, 20) == pytest.approx(0.0805)
    # Background 30 s longer than a 10 s interval: each save also waits 20 s for the previous one:
    # stall 21, segment 31, lost 15.5 + 30 = 45.5, overhead 21/10 + 45.5/1000.
    assert expected_lost_work(10, 1, 30) == pytest.approx(45.5)
    assert expected_overhead(10, 1, 1000, 30) == pytest.approx(2.1455)


def test_young_minimises_the_first_order_overhead_and_background_only_bounds_it():
    taus = np.linspace(1.0, 5000.0, 49_991)  # steps of 0.1 s

    def best(delta, mtbf, background=0.0):
        return taus[np.argmin([expected_overhead(t, delta, mtbf, background) for t in taus])]
    assert best(10, 8 * HOUR) == pytest.approx(young_interval(10, 8 * HOUR), abs=0.1)
    assert best(10, 8 * HOUR, 300) == pytest.approx(young_interval(10, 8 * HOUR), abs=0.1)  # b below the optimum
    assert best(10, 8 * HOUR, 1500) == pytest.approx(1500, abs=0.1)  # b beyond it: as soon as the write ends


def test_lost_work_matches_a_simulated_timeline_of_async_saves():
    """Saves staged every T seconds, durable b later; a failure loses everything since the state of the
    last durable one was taken."""
    rng = np.random.default_rng(0)
    interval, stall, background = 100.0, 4.0, 30.0
    segment = interval + stall
    failures = rng.uniform(10 * segment, 1000 * segment, 200_000)
    latest_stage = np.floor(failures / segment) * segment
    durable = np.where(failures - latest_stage >= background, latest_stage, latest_stage - segment)
    assert np.mean(failures - durable) == pytest.approx(expected_lost_work(interval, stall, background), rel=0.01)


def test_auto_interval_in_steps():
    assert auto_interval(2, 1.0, 9) == 5  # 384/81 = 4.74 s of 1 s steps
    assert auto_interval(2, 10.0, 9) == 1  # never less than one step
    assert auto_interval(2, 1.0, 9, background_s=30) == 30  # never before the previous save is written
    assert auto_interval(60, 2.0, DAY) == round(daly_interval(60, DAY) / 2.0)
    for bad in ({"step_s": 0}, {"mtbf_s": -1}, {"stall_s": float("nan")}, {"background_s": -1}, {"mtbf_s": True}):
        with pytest.raises(ValueError, match=r"must be a (positive|non-negative) number of seconds"):
            auto_interval(**{"stall_s": 1.0, "step_s": 1.0, "mtbf_s": HOUR, **bad})
    with pytest.raises(ValueError, match="checkpoint interval must be a positive"):
        expected_overhead(0, 1.0, HOUR)


def test_an_async_save_blocks_only_for_its_stage_phases():
    def phases(**durations):
        return [{"name": name, "start_ns": 0, "duration_s": d} for name, d in durations.items()]
    meta = {"timing": {"ranks": [  # spec 9.4's shape
        {"rank": 0, "total_s": 2.5, "phases": phases(stage=0.5, prepare=0.25, write_chunks=1.5, sync=0.25)},
        {"rank": 1, "total_s": 3.0, "phases": phases(prepare=1.0, write_chunks=2.0)},
    ]}}
    asynchronous, synchronous = save_timing(meta)
    assert rank_split(asynchronous) == (0.5, 2.0, True)
    assert rank_split(synchronous) == (3.0, 0.0, False)


# -- advice from real repositories ---------------------------------------------------------------
def run(url: str, state_of, *, steps: int = 30, every: int = 10, step_s: float = 0.01,
        **options) -> tuple[float, float]:
    """A training loop of ``steps`` sleeps of ``step_s`` timed by a StepTimer, saving every ``every`` steps.

    Returns the median step time as the loop measured it inside the timed step and around it: the
    timer's own lies between the two, however long a loaded machine makes the steps."""
    timer = ckptfmt.StepTimer()
    inside, around = [], []
    for step in range(1, steps + 1):
        before = time.perf_counter_ns()  # the StepTimer's clock
        with timer.step(step):
            start = time.perf_counter_ns()
            time.sleep(step_s)
            inside.append((time.perf_counter_ns() - start) / 1e9)
        around.append((time.perf_counter_ns() - before) / 1e9)
        if step % every == 0:
            ckptfmt.save(state_of(), f"{url}/step-{step:06d}", step=step, timer=timer, **options)
    return statistics.median(inside), statistics.median(around)


def slowest_totals(url: str) -> list[float]:
    totals = []
    for record in ckptfmt.Repository.open(url).commits():
        with ckptfmt.open(f"{url}/{record.name}") as ckpt:
            totals.append(max(r["total_s"] for r in ckpt.metadata["timing"]["ranks"]))
    return totals


def test_advice_reflects_the_measured_stall_and_step_time(tmp_path):
    small, large = str(tmp_path / "small"), str(tmp_path / "large")
    measured = {small: run(small, lambda: {"w": torch.randn(16)}),
                large: run(large, lambda: {"w": torch.randn(16 * 2**20)})}  # 64 MiB of new bytes each save
    a, b = advise(small, mtbf=8 * HOUR), advise(large, mtbf=8 * HOUR)
    for advice, url in ((a, small), (b, large)):
        assert advice.saves == 3 and advice.asynchronous == 0 and advice.background_s == 0.0
        assert advice.stall_s == statistics.median(slowest_totals(url))
        inside, around = measured[url]
        assert advice.step_source == "step records" and 0.01 <= inside <= advice.step_s <= around
        assert advice.actual.steps == 10 and advice.actual.interval_s == pytest.approx(10 * advice.step_s)
        assert advice.young.steps == round(young_interval(advice.stall_s, 8 * HOUR) / advice.step_s)
        assert advice.daly.steps == auto_interval(advice.stall_s, advice.step_s, 8 * HOUR)
        assert advice.daly.overhead < advice.actual.overhead  # saving every 10 steps of 10 ms is far too often
        assert advice.checkpoints_ratio == pytest.approx(advice.actual.interval_s / advice.daly.interval_s)
    assert b.stall_s > a.stall_s and b.daly.interval_s > a.daly.interval_s
    assert advise(small, mtbf=HOUR).daly.steps < a.daly.steps  # failing more often: save more often


def test_step_time_from_step_times_or_checkpoint_spacing(tmp_path):
    given = str(tmp_path / "given")
    for step in (10, 20, 30):
        ckptfmt.save({"w": torch.zeros(4)}, f"{given}/s{step}", step=step, step_times=[0.5, 0.25, 0.5])
    advice = advise(given, mtbf=DAY)
    assert (advice.step_source, advice.step_s) == ("step_times", 0.5)
    assert advise(given, mtbf=timedelta(days=1)) == advice  # as CheckpointManager(mtbf=) takes it
    for wrong in ("86400", True, timedelta(0)):
        with pytest.raises(ValueError, match="the MTBF must be a positive number of seconds"):
            advise(given, mtbf=wrong)

    spaced = str(tmp_path / "spaced")
    calls = []  # time.time_ns() before and after each save: its checkpoint's created_ns lies between
    for step in (0, 10, 20, 30):
        if step:
            time.sleep(0.2)  # ten steps of 20 ms
        before = time.time_ns()
        ckptfmt.save({"w": torch.zeros(4)}, f"{spaced}/s{step}", step=step)
        calls.append((before, time.time_ns()))
    advice = advise(spaced, mtbf=DAY)
    assert advice.step_source == "checkpoint spacing" and advice.actual.steps == 10

    def step_time(spacings_ns) -> float:  # the median spacing less the save's stall, per step
        return statistics.median((ns / 1e9 - advice.stall_s) / 10 for ns in spacings_ns)
    shortest = [b[0] - a[1] for a, b in zip(calls, calls[1:])]  # from the end of one save to the next's start
    longest = [b[1] - a[0] for a, b in zip(calls, calls[1:])]
    assert min(shortest) >= 0.2e9 and step_time(shortest) <= advice.step_s <= step_time(longest)


def test_async_saves_give_advice(tmp_path):
    url = str(tmp_path / "async")
    timer = ckptfmt.StepTimer()
    for step in range(1, 31):
        with timer.step(step):
            time.sleep(0.005)
        if step % 10 == 0:
            future = ckptfmt.async_save({"w": torch.randn(1024)}, f"{url}/step-{step:06d}", step=step, timer=timer)
    future.result(timeout=60)  # one save per repository in flight: the last one done, all are
    advice = advise(url, mtbf=HOUR)
    assert advice.saves == 3 and advice.stall_s > 0 and advice.actual.steps == 10 and advice.daly.steps >= 1


def test_too_few_checkpoints_or_steps_are_errors(tmp_path):
    url = str(tmp_path / "run")
    ckptfmt.Repository.open(url, create=True)
    with pytest.raises(ckptfmt.CheckpointError, match=r"0 checkpoint\(s\) saved by training; advice needs at least 2"):
        advise(url, mtbf=HOUR)
    ckptfmt.save({"w": torch.zeros(4)}, f"{url}/a", step=1)
    with pytest.raises(ckptfmt.CheckpointError, match=r"1 checkpoint\(s\) saved by training"):
        advise(url, mtbf=HOUR)
    ckptfmt.save({"w": torch.zeros(4)}, f"{url}/b", provenance={"source_kind": "torch", "source": "/x.pt"})
    with pytest.raises(ckptfmt.CheckpointError, match=r"1 checkpoint\(s\) saved by training and 1 imported"):
        advise(url, mtbf=HOUR)
    ckptfmt.save({"w": torch.zeros(4)}, f"{url}/c")  # no step number
    with pytest.raises(ckptfmt.CheckpointError, match=r"increasing step numbers.*2 saved by training, 1 of them"):
        advise(url, mtbf=HOUR)
    with pytest.raises(ckptfmt.CheckpointNotFoundError):
        advise(str(tmp_path / "nothing"), mtbf=HOUR)


# -- the command ---------------------------------------------------------------------------------
def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ckptfmt")
    advise_cli.register(p.add_subparsers(dest="command", required=True))
    return p


@pytest.mark.parametrize("text, seconds", [("90s", 90), ("30m", 1800), ("8h", 28800), ("2d", 172800),
                                           ("3600", 3600), ("1.5h", 5400), (" 8H ", 28800)])
def test_durations(text, seconds):
    assert parser().parse_args(["advise", "r", "--mtbf", text]).mtbf == seconds


@pytest.mark.parametrize("text", ["abc", "-5m", "0", "8x", "h", "1e9999", ""])
def test_bad_durations_are_one_line_errors(text, capsys):
    with pytest.raises(SystemExit) as exit_:
        parser().parse_args(["advise", "r", f"--mtbf={text}"])
    assert exit_.value.code == 2 and "is not a positive duration" in capsys.readouterr().err


def test_command_prints_a_table_and_json(tmp_path):
    url = str(tmp_path / "run")
    run(url, lambda: {"w": torch.randn(256)})
    out = io.StringIO()
    args = parser().parse_args(["advise", url, "--mtbf", "2h", "--json"])
    assert args.run(args, Console(file=out)) == 0
    data = json.loads(out.getvalue())
    assert data["mtbf_s"] == 7200 and data["actual"]["steps"] == 10 and data["saves"] == 3
    assert data["daly"]["steps"] == auto_interval(data["stall_s"], data["step_s"], 7200)

    out = io.StringIO()
    args = parser().parse_args(["advise", url])
    assert advise_cli.advise_command(args, Console(file=out, width=200)) == 0
    text = out.getvalue()
    assert "MTBF 8.0 h" in text and f"Save every {advise(url, mtbf=8 * HOUR).daly.steps} steps (Daly)" in text
    assert all(label in text for label in ("actual", "Young", "Daly (advice)", "lost per failure"))


def test_command_error_is_a_checkpoint_error(tmp_path):
    url = str(tmp_path / "run")
    ckptfmt.save({"w": torch.zeros(4)}, f"{url}/a", step=1)
    with pytest.raises(ckptfmt.CheckpointError, match="at least 2"):
        advise_cli.advise_command(parser().parse_args(["advise", url]), Console(file=io.StringIO()))


def test_durations_read_in_their_best_unit():
    assert [advise_cli.duration(s) for s in (0.085, 42, 750, 8 * HOUR, 2 * DAY)] == [
        "85.0 ms", "42.0 s", "12.5 min", "8.0 h", "2.0 d"]
