"""Real gloo DDP training runs with injected stragglers, trained once per test session and shared.

test_stragglers, test_report and test_tui_run read the same runs (the
``ddp_runs`` fixture of conftest.py): each run in ``RUNS`` is trained on first
use, on real gloo ranks (tests/support/ranks.py). Chosen ranks sleep ``SLEEP_S`` in
chosen steps, in their data or forward phase; the others wait for them in
backward's all-reduce. Every 8 steps a collective checkpoint stores the steps.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

import ckptfmt
from ckptfmt.analytics import Thresholds
from tests.support.ranks import run_ranks

#: Seconds a straggler sleeps in each of its steps.
SLEEP_S = 0.6
#: More ranks than cores share a CI machine, so the OS deschedules a rank for tens of milliseconds now
#: and then: real delays, but not injected ones. The tests report delays of half a sleep or more.
MIN_DELAY_S = SLEEP_S / 2


@dataclass(frozen=True)
class Sleep:
    rank: int
    first: int
    last: int
    phase: str  # data or forward


@dataclass(frozen=True)
class Run:
    """A training run to make: its world size, steps and the sleeps injected."""

    world: int
    steps: int
    sleeps: tuple[Sleep, ...]

    def injected(self) -> set[tuple[int, int]]:
        """The (rank, step) pairs that slept."""
        return {(s.rank, step) for s in self.sleeps for step in range(s.first, s.last + 1)}


RUNS = {
    "four": Run(4, 24, (Sleep(1, 4, 7, "data"), Sleep(2, 15, 16, "forward"), Sleep(3, 20, 20, "data"))),
    "two": Run(2, 24, (Sleep(1, 12, 15, "data"), Sleep(0, 19, 19, "forward"))),
    "three": Run(3, 16, (Sleep(2, 3, 4, "forward"), Sleep(0, 9, 11, "data"))),
}


class DdpRuns:
    """The runs of ``RUNS``, each trained on first use into ``folder``: ``runs["two"]`` is its repository URL."""

    def __init__(self, folder: Path):
        self.folder, self.made = folder, {}

    def __getitem__(self, name: str) -> str:
        if name not in self.made:
            self.made[name] = train_run(RUNS[name], self.folder / name)
        return self.made[name]


def train_run(run: Run, folder: Path) -> str:
    """Train ``run`` on real gloo ranks; returns its repository URL."""
    repo = str(folder / "repo")
    for outcome in run_ranks(ddp_training, run.world, folder / "ranks", repo=repo, run=run):
        outcome.unwrap()
    return repo


def ddp_training(rank: int, world: int, folder: Path, repo: str, run: Run) -> str:
    """A small DDP model trained for ``run.steps`` steps; collective checkpoints with the timer every 8 steps."""
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                                        torch.nn.Linear(256, 8)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    timer = ckptfmt.StepTimer()
    generator = torch.Generator().manual_seed(rank)
    sleeps = {(s.phase, step) for s in run.sleeps if s.rank == rank for step in range(s.first, s.last + 1)}
    url = None
    for step in range(run.steps):
        with timer.step(step):
            with timer.phase("data"):
                x = torch.randn(32, 64, generator=generator)
                timer.batch(torch.arange(32) + 32 * (world * step + rank))
                if ("data", step) in sleeps:
                    time.sleep(SLEEP_S)
            with timer.phase("forward"):
                loss = model(x).square().mean()
                if ("forward", step) in sleeps:
                    time.sleep(SLEEP_S)
            with timer.phase("backward"):  # DDP's all-reduce: where the others wait
                optimizer.zero_grad()
                loss.backward()
            with timer.phase("optimizer"):
                optimizer.step()
        timer.metrics(loss=loss.item())
        if step % 8 == 7:
            url = ckptfmt.save({"model": model.module.state_dict()}, f"{repo}/step-{step:04d}", step=step,
                               timer=timer, timeout=60)
    return url


#: The real runs share 2 cores among their ranks (and with whatever else runs): the OS deschedules a
#: rank for tens of milliseconds now and then, a real delay but not an injected one.
NOISY_MACHINE = Thresholds(floor_s=MIN_DELAY_S)


def flagged(report: dict) -> set[tuple[int, int]]:
    """The (rank, step) pairs a stragglers() report (as JSON) flags."""
    return {(s["rank"], step) for s in report["stragglers"] for step in s["steps"]}
