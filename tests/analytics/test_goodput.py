"""``ckptfmt goodput``: a run's wall time split into productive steps, data waits, save stalls, restarts,
steps computed again, straggler waits and the rest, from its records alone, checked against the
timeline the run logged by its own clock.

tests/scripts/goodput_run.py trains 20 steps, killed (SIGKILL) after step 5 and again after step 13,
each time restarted and resumed from its newest checkpoint (every 4 steps): steps 4-5 and 12-13 are
computed twice."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ckptfmt
from ckptfmt.analytics.goodput import CATEGORIES, CATEGORY_NAMES, goodput
from ckptfmt.cli import main
from tests.support.helpers import SCRIPTS, script_env

STEPS = 20


def run(repo: Path, log: Path, kill_after: int, ranks: int = 0) -> None:
    """One launch of goodput_run.py: alone, or on ``ranks`` ranks under torchrun (whose exit code is 1
    when its ranks were killed)."""
    launcher = [] if not ranks else ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)]
    result = subprocess.run([sys.executable, *launcher, str(SCRIPTS / "goodput_run.py"), str(repo), str(STEPS),
                             str(kill_after), str(log)], capture_output=True, text=True, timeout=120,
                            env=script_env())
    expected = 0 if kill_after < 0 else 1 if ranks else -9
    assert result.returncode == expected, result.stderr[-3000:]


def truth(log: Path) -> dict[str, float]:
    """The split by the run's own log, with goodput's definitions."""
    computations, saves, resumes = [], [], []
    for line in log.read_text().splitlines():
        kind, *fields = line.split()
        if kind == "step":
            computations.append((int(fields[0]), int(fields[1]), int(fields[2]), float(fields[3])))
        elif kind == "save":
            saves.append((int(fields[0]), int(fields[1])))
        else:
            resumes.append(int(fields[0]))
    kept = {c[0]: c for c in computations}  # the last computation of each step
    wasted = [c for c in computations if kept[c[0]] is not c]
    seconds = dict.fromkeys(CATEGORIES, 0.0)
    seconds["data_waits"] = sum(c[3] for c in kept.values())
    seconds["productive"] = sum((c[2] - c[1]) / 1e9 - c[3] for c in kept.values())
    seconds["recomputed"] = sum((c[2] - c[1]) / 1e9 for c in wasted)
    seconds["save_stalls"] = sum((end - start) / 1e9 for start, end in saves)
    ends = [c[2] for c in computations] + [end for _, end in saves]
    for resumed in resumes:
        stopped = max(end for end in ends if end < resumed)
        seconds["restarts"] += (min(c[1] for c in computations if c[1] > resumed) - stopped) / 1e9
    wall = (max(ends) - min(c[1] for c in computations)) / 1e9
    seconds["other"] = wall - sum(seconds.values())
    return {"wall_s": wall, **seconds}


@pytest.mark.slow
def test_a_run_killed_and_resumed_twice_is_split_as_its_own_log_says(tmp_path, capsys):
    repo, log = tmp_path / "run", tmp_path / "timeline.log"
    for kill_after in (5, 13, -1):
        run(repo, log, kill_after)
    expected = truth(log)
    found = goodput(repo)
    assert (found.ranks, found.steps_kept, found.steps_recomputed) == (1, STEPS, 4)
    assert found.wall_s == pytest.approx(expected["wall_s"], rel=0.01)
    for name in CATEGORIES:  # within 5% of each share, or half a percent of the wall time for the smallest
        share, true_share = found.shares[name], expected[name] / expected["wall_s"]
        assert abs(share - true_share) <= max(0.05 * true_share, 0.005), (name, share, true_share)
    assert [(r["from"], r["from_step"]) for r in found.restarts] == [("step-004", 4), ("step-012", 12)]
    assert found.world_sizes == [{"from_ns": found.world_sizes[0]["from_ns"], "world_size": 1}]
    assert main(["goodput", str(repo)]) == 0
    out = capsys.readouterr().out
    assert all(len(line) <= 80 for line in out.splitlines()), out
    assert "restarts" in out and "step-004" in out
    assert main(["goodput", str(repo), "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert set(document["seconds"]) == set(CATEGORIES) and len(document["restarts"]) == 2
    from ckptfmt.analytics.report import report

    report(str(repo), html_path=tmp_path / "report.html")
    page = (tmp_path / "report.html").read_text()
    rows = re.findall(r"<tr><td>(.*?)</td><td>(.*?)</td><td>(.*?)</td></tr>",
                      re.search(r"<table id='goodput'>.*?</table>", page, flags=re.S).group(0))
    assert [row[0] for row in rows] == [CATEGORY_NAMES[name] for name in CATEGORIES]
    restarts = re.search(r"<table id='restarts'>.*?</table>", page, flags=re.S).group(0)
    assert "step-004" in restarts and "step-012" in restarts


@pytest.mark.slow
def test_a_process_killed_before_its_first_save_after_a_resume_is_a_restart_all_the_same(tmp_path):
    """Issue 46: a restarted process's resume was in memory until its first save, so one killed before it
    vanished: goodput dropped that restart and took its steps for restart time. Its resume is now in its
    progress object at once, and its steps from its first one."""
    repo, log = tmp_path / "run", tmp_path / "timeline.log"
    for kill_after in (5, 6, -1):  # the second process resumes from step-004, dies after step 6: no save
        run(repo, log, kill_after)
    expected = truth(log)
    found = goodput(repo)
    assert [(r["from"], r["from_step"]) for r in found.restarts] == [("step-004", 4), ("step-004", 4)]
    assert (found.steps_kept, found.steps_recomputed) == (STEPS, 2 + 3)  # steps 4-5, then 4-6, again
    for name in ("restarts", "recomputed"):
        assert found.seconds[name] == pytest.approx(expected[name], rel=0.05, abs=0.005), name


@pytest.mark.distributed
@pytest.mark.exhaustive  # 13 s of ranks: make test keeps the one-process run killed twice
def test_a_two_rank_job_killed_and_resumed_twice_is_split_as_its_ranks_logs_say(tmp_path):
    """The same timeline on 2 gloo ranks saving collectively, the whole job killed twice (each rank's
    progress object holds what it computed after the last save): goodput's shares are the mean of the
    ranks' true ones, within 5%."""
    repo, log = tmp_path / "run", tmp_path / "timeline.log"
    for kill_after in (5, 13, -1):
        run(repo, log, kill_after, ranks=2)
    truths = [truth(Path(f"{log}.{rank}")) for rank in (0, 1)]
    found = goodput(repo)
    assert (found.ranks, found.steps_kept, found.steps_recomputed) == (2, STEPS, 4)
    wall = sum(each["wall_s"] for each in truths) / 2
    assert found.wall_s == pytest.approx(wall, rel=0.01)
    for name in CATEGORIES:
        share, true_share = found.shares[name], sum(each[name] for each in truths) / 2 / wall
        assert abs(share - true_share) <= max(0.05 * true_share, 0.005), (name, share, true_share)
    assert sorted((r["rank"], r["from"]) for r in found.restarts) == [
        (0, "step-004"), (0, "step-012"), (1, "step-004"), (1, "step-012")]


def train_on_two_ranks(rank: int, world: int, folder, repo: str, stop: int | None = None) -> None:
    """Data parallel on gloo ranks, gradients averaged each step (the ranks wait for each other); rank 1
    is 0.1 s slow in its forward phase at steps 3, 4 and 5; a collective save every 2 steps; it stops
    after step ``stop``, or resumes from the newest checkpoint and trains to step 10."""
    import time

    import torch
    import torch.distributed as dist

    import ckptfmt

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    timer = ckptfmt.StepTimer(system_interval=None)
    first = 0
    if stop is None:
        url = f"{repo}/{ckptfmt.Repository.open(repo).commits()[-1].name}"
        state = ckptfmt.load(url)
        model.load_state_dict(state["model"])
        first = state["step"]
        ckptfmt.record_resume(url, {"model": model})
    for step in range(first, 10 if stop is None else stop):
        with timer.step(step):
            with timer.phase("data"):
                time.sleep(0.01)
            with timer.phase("forward"):
                loss = model(torch.ones(2, 4)).square().mean()
                loss.backward()
                time.sleep(0.02 + (0.1 if rank == 1 and step in (3, 4, 5) else 0.0))
            with timer.phase("sync"):
                for parameter in model.parameters():
                    dist.all_reduce(parameter.grad)
        timer.metrics(loss=loss.detach())
        if (step + 1) % 2 == 0:
            ckptfmt.save({"model": model.state_dict(), "step": step + 1}, f"{repo}/step-{step + 1:02d}", step=step + 1,
                         timer=timer)


@pytest.mark.distributed
def test_two_ranks_wait_on_their_straggler_and_each_records_its_restart(tmp_path):
    from tests.support.ranks import run_ranks

    repo = str(tmp_path / "run")
    for outcome in run_ranks(train_on_two_ranks, 2, tmp_path / "a", repo=repo, stop=6):
        outcome.unwrap()
    for outcome in run_ranks(train_on_two_ranks, 2, tmp_path / "b", repo=repo):
        outcome.unwrap()
    found = goodput(repo)
    assert (found.ranks, found.steps_kept, found.steps_recomputed) == (2, 10, 0)
    assert found.seconds["straggler_waits"] == pytest.approx(0.3, abs=0.08)  # 3 steps of 0.1 s, every rank
    assert sorted((r["rank"], r["from"]) for r in found.restarts) == [(0, "step-06"), (1, "step-06")]
    assert found.seconds["restarts"] > 0.1 and found.world_sizes[-1]["world_size"] == 2
    assert sum(found.seconds.values()) == pytest.approx(found.wall_s, rel=1e-6)


def test_the_run_keyword_is_the_old_name_of_repo_and_warns(tmp_path):
    """Issue 50: one-run analyses name the run's repository ``repo`` (``health(repo)``); ``run=`` still works."""
    repo = tmp_path / "run"
    timer = ckptfmt.StepTimer()
    for step in range(3):
        with timer.step(step):
            pass
    ckptfmt.save({"w": torch.ones(4)}, repo / "step-2", step=2, timer=timer)
    with pytest.warns(DeprecationWarning, match=r"goodput\(run=...\) is deprecated: use repo="):
        old = goodput(run=repo)
    new = goodput(repo=repo)  # wall time runs to now: a run with no end recorded may still be running
    assert (old.run, old.steps_kept, old.ranks) == (new.run, new.steps_kept, new.ranks) == (new.run, 3, 1)
