"""A checkpoint written by rank 0 alone still holds every rank's training steps (gather_steps, spec 9.4),
so stragglers are found in runs whose framework saves from one rank (Lightning under DDP)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import ckptfmt
from ckptfmt.analytics import Thresholds, stragglers, tables
from ckptfmt.distributed.steps import gather_steps
from ckptfmt.metadata.step_timer import decode_steps
from tests.support.ranks import run_ranks

STEPS = 24
SLOW_RANK, SLOW_STEPS, SLEEP_S = 1, range(12, 16), 0.25


def train_and_save_from_rank_zero(rank: int, world: int, folder: Path, repo: str) -> int | None:
    """A DDP-like loop (an all-reduce ends every step) in which rank 1 is slow to fetch some batches;
    then every rank gathers its steps and rank 0 alone saves."""
    timer = ckptfmt.StepTimer()
    weights = torch.zeros(64)
    for step in range(STEPS):
        with timer.step(step):
            with timer.phase("data"):
                if rank == SLOW_RANK and step in SLOW_STEPS:
                    time.sleep(SLEEP_S)
            with timer.phase("backward"):
                gradient = torch.full((64,), float(rank + 1))
                dist.all_reduce(gradient)
                weights -= 0.01 * gradient
    gathered = gather_steps(timer)
    assert len(timer) == 0  # what was sent leaves every rank's timer
    if rank != 0:
        assert gathered is None
        return None
    ckptfmt.save({"weights": weights}, f"{repo}/step-{STEPS}", step=STEPS, coordinated=False,
                 gathered_steps=gathered)
    return len(gathered)


def test_rank_zero_saves_every_ranks_steps_and_the_slow_rank_is_found(tmp_path):
    repo = str(tmp_path / "repo")
    outcomes = [o.unwrap() for o in run_ranks(train_and_save_from_rank_zero, 2, tmp_path / "ranks", repo=repo)]
    assert outcomes == [2, None]
    with ckptfmt.open(f"{repo}/step-{STEPS}") as reader:
        timing, topology = reader.metadata["timing"], reader.metadata["topology"]
    assert topology["writer_ranks"] == [0] and topology["world_size"] == 2
    assert [entry["rank"] for entry in timing["ranks"]] == [0, 1]
    writer, sender = timing["ranks"]
    assert writer["phases"] and sender["phases"] == [] and sender["total_s"] == 0.0
    for entry in timing["ranks"]:
        assert decode_steps(entry["steps"], "test").step.tolist() == list(range(STEPS))
    steps = tables(repo)["steps"]
    assert sorted(set(steps["rank"].to_pylist())) == [0, 1]
    report = stragglers(repo, thresholds=Thresholds(floor_s=0.1))
    found = {(s.rank, step) for s in report.stragglers for step in s.steps}
    assert found == {(SLOW_RANK, step) for step in SLOW_STEPS}, report.stragglers


def test_gathered_steps_without_a_group_are_this_process_s():
    timer = ckptfmt.StepTimer()
    with timer.step(3):
        pass
    (entry,) = gather_steps(timer)
    assert entry["rank"] == 0 and decode_steps(entry["steps"], "test").step.tolist() == [3]


@pytest.mark.parametrize("gathered, error, message", [
    ({"rank": 0}, TypeError, r"^gathered_steps must be a list"),
    ([{"rank": 0, "host": "h"}], TypeError,
     r"^gathered_steps\[0\] must be a dict with the keys rank, host and steps \(and resumes\)$"),
    ([{"rank": -1, "host": "h", "steps": {}}], ValueError, r"rank must be a distinct non-negative integer, not -1"),
    ([{"rank": 1, "host": 7, "steps": {}}], TypeError, r"^gathered_steps\[0\]: host must be a string$"),
    ([{"rank": 1, "host": "h", "steps": {"count": 2}}], ValueError, r"steps must be a StepTimer.snapshot\(\)"),
], ids=["not-a-list", "keys", "rank", "host", "steps"])
def test_bad_gathered_steps_are_refused_before_anything_is_written(tmp_path, gathered, error, message):
    with pytest.raises(error, match=message):
        ckptfmt.save({"w": torch.ones(2)}, tmp_path / "repo" / "a", gathered_steps=gathered)
    assert not (tmp_path / "repo").exists()
