"""ckptfmt.analytics.stragglers and `ckptfmt stragglers`: who delayed the others, when, by how much.

Judged by precision and recall over (rank, step) pairs against injected delays:
on real 4-rank gloo DDP runs (chosen ranks sleep in chosen steps, in their data
or forward phase; the others wait in backward's all-reduce) and on simulated
64-rank timing tables with jitter.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch

import ckptfmt
from ckptfmt.analytics import Thresholds, stragglers, tables

from ranks import run_ranks


def precision_recall(found: set, injected: set) -> tuple[float, float]:
    hits = len(found & injected)
    return hits / max(len(found), 1), hits / max(len(injected), 1)


def flagged(report: dict) -> set[tuple[int, int]]:
    return {(s["rank"], step) for s in report["stragglers"] for step in s["steps"]}


# -- real DDP runs ------------------------------------------------------------------------------
#: (rank, first step, last step, phase) of the sleeps injected into the 4-rank runs.
SLEEPS = [(1, 4, 7, "data"), (2, 15, 16, "forward"), (3, 20, 20, "data")]
SLEEP_S = 0.2
#: Four ranks share two cores here, so the OS deschedules a rank for up to tens of milliseconds in any
#: step: real delays, but not injected ones. The DDP tests report delays of half a sleep or more.
MIN_DELAY_S = SLEEP_S / 2
NOISY_MACHINE = Thresholds(floor_s=MIN_DELAY_S)


def ddp_training(rank: int, world: int, folder: Path, repo: str, steps: int) -> str:
    """A small DDP model trained for ``steps`` steps; collective checkpoints with the timer every 8 steps."""
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                                        torch.nn.Linear(256, 8)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    timer = ckptfmt.StepTimer()
    generator = torch.Generator().manual_seed(rank)
    url = None
    for step in range(steps):
        with timer.step(step):
            with timer.phase("data"):
                x = torch.randn(32, 64, generator=generator)
                timer.batch(torch.arange(32) + 32 * (world * step + rank))
                if any(r == rank and first <= step <= last and p == "data" for r, first, last, p in SLEEPS):
                    time.sleep(SLEEP_S)
            with timer.phase("forward"):
                loss = model(x).square().mean()
                if any(r == rank and first <= step <= last and p == "forward" for r, first, last, p in SLEEPS):
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


def ddp_run_in(folder: Path, steps: int) -> str:
    """A 4-rank DDP run of ``steps`` steps with the SLEEPS injected; returns its repository URL."""
    repo = str(folder / "run")
    for outcome in run_ranks(ddp_training, 4, folder / "ranks", repo=repo, steps=steps):
        outcome.unwrap()
    return repo


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory) -> str:
    return ddp_run_in(tmp_path_factory.mktemp("ddp"), steps=24)


def test_the_ranks_that_slept_are_found_in_the_steps_they_slept(ddp_run):
    report = stragglers(ddp_run, thresholds=NOISY_MACHINE)
    injected = {(r, s) for r, first, last, _ in SLEEPS for s in range(first, last + 1)}
    precision, recall = precision_recall(flagged(report), injected)
    assert precision >= 0.95 and recall >= 0.95, (precision, recall, report["stragglers"])
    assert report["steps"] == 24 and report["ranks"] == 4
    by_rank = {s["rank"]: s for s in report["stragglers"]}
    assert by_rank[1]["phase"] == "data" and by_rank[2]["phase"] == "forward"
    assert by_rank[1]["episodes"][0]["first_step"] == 4 and by_rank[1]["episodes"][0]["last_step"] == 7
    assert all(s["kind"] == "transient" for s in report["stragglers"])
    assert SLEEP_S * 0.8 < by_rank[1]["max_delay_s"] < SLEEP_S * 2 and by_rank[1]["ratio"] > 5


def test_total_step_time_would_not_have_told(ddp_run):
    """The reason for the method: the others wait for the straggler, so every rank's step is as long."""
    steps = tables(ddp_run)["steps"].to_pylist()
    step_5 = sorted(s["duration_s"] for s in steps if s["step"] == 5)
    assert step_5[0] > SLEEP_S * 0.8  # even the fastest rank's step took the sleep
    backward = {s["rank"]: s["phase_backward"] for s in steps if s["step"] == 5}
    assert min(backward, key=backward.get) == 1  # the straggler waits least


def test_the_cli_prints_the_report_as_json(ddp_run):
    min_delay = ["--min-delay", str(MIN_DELAY_S)]
    result = subprocess.run([sys.executable, "-m", "ckptfmt.cli", "stragglers", ddp_run, "--json", *min_delay],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["stragglers"] == stragglers(ddp_run, thresholds=NOISY_MACHINE)["stragglers"]
    assert {(s["rank"], s["host"]) for s in report["stragglers"]} >= {(1, report["stragglers"][0]["host"])}
    assert {"rank", "host", "steps", "delay_s", "ratio", "phase", "kind", "episodes"} <= set(report["stragglers"][0])
    text = subprocess.run([sys.executable, "-m", "ckptfmt.cli", "stragglers", ddp_run, *min_delay],
                          capture_output=True, text=True, timeout=120)
    assert text.returncode == 0 and "rank" in text.stdout and "4-7" in text.stdout
    refused = subprocess.run([sys.executable, "-m", "ckptfmt.cli", "stragglers", ddp_run, "--min-delay", "-1"],
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "--min-delay" in refused.stderr and refused.stderr.count("\n") == 1


# -- simulated 64-rank runs ---------------------------------------------------------------------------
def simulated(ranks: int = 64, steps: int = 200, seed: int = 0, hosts_of: int = 8):
    """A synchronous run's steps table: every rank computes data/forward/backward with jitter, then
    all-reduces; the others wait for the slowest in backward. Returns the table and the injected pairs."""
    rng = np.random.default_rng(seed)
    base = {"data": 0.05, "forward": 0.15, "backward": 0.25, "optimizer": 0.04}
    own = {p: base[p] * rng.lognormal(0.0, 0.06, size=(steps, ranks)) for p in base}
    own["data"] += rng.exponential(0.002, size=(steps, ranks))  # data loading has a tail
    hiccup = rng.random((steps, ranks)) < 0.002  # a preempted process now and then
    own["forward"] += hiccup * 0.006
    injected = set()

    def slow(rank_list, step_list, phase, seconds):
        for r in rank_list:
            for s in step_list:
                own[phase][s, r] += seconds
                injected.add((r, s))
    for _ in range(30):  # transient: one rank, a few steps
        rank, first = int(rng.integers(ranks)), int(rng.integers(steps - 5))
        slow([rank], range(first, first + int(rng.integers(1, 5))), str(rng.choice(["data", "forward"])),
             float(rng.uniform(0.04, 0.3)))
    slow([7], range(100, 200), "forward", 0.06)  # persistent: rank 7 from step 100 on
    slow(range(16, 24), range(50, 54), "data", 0.1)  # a whole host
    compute = own["data"] + own["forward"] + own["backward"]
    wait = compute.max(axis=1, keepdims=True) - compute
    backward = own["backward"] + wait + 0.01 * rng.lognormal(0, 0.05, size=(steps, ranks))  # + the all-reduce
    duration = own["data"] + own["forward"] + backward + own["optimizer"]
    step_grid, rank_grid = np.meshgrid(np.arange(steps), np.arange(ranks), indexing="ij")
    table = pa.table({
        "run": ["sim"] * (steps * ranks), "checkpoint": ["c"] * (steps * ranks),
        "rank": rank_grid.ravel(), "host": [f"node{r // hosts_of}" for r in rank_grid.ravel()],
        "step": step_grid.ravel(), "duration_s": duration.ravel(),
        "phase_data": own["data"].ravel(), "phase_forward": own["forward"].ravel(),
        "phase_backward": backward.ravel(), "phase_optimizer": own["optimizer"].ravel(),
    })
    return table, injected


def empty_saves() -> pa.Table:
    return pa.table({"name": pa.array([], pa.string()), "rank": pa.array([], pa.int64()),
                     "host": pa.array([], pa.string()), "phase": pa.array([], pa.string()),
                     "duration_s": pa.array([], pa.float64()), "rank_total_s": pa.array([], pa.float64())})


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_simulated_64_rank_runs_with_jitter(seed):
    steps, injected = simulated(seed=seed)
    report = stragglers({"steps": steps, "saves": empty_saves()})
    precision, recall = precision_recall(flagged(report), injected)
    assert precision >= 0.95 and recall >= 0.95, (seed, precision, recall)
    rank_7 = next(s for s in report["stragglers"] if s["rank"] == 7)
    assert rank_7["kind"] == "persistent" and rank_7["phase"] == "forward"
    assert any(e["first_step"] <= 100 and e["last_step"] == 199 for e in rank_7["episodes"])
    node2 = next(h for h in report["hosts"] if h["host"] == "node2")
    assert sorted(node2["ranks"]) == list(range(16, 24)) and {50, 51, 52, 53} <= set(node2["steps"])


def test_a_run_without_stragglers_reports_none():
    rng = np.random.default_rng(9)
    ranks, count = 64, 100
    table = pa.table({
        "rank": np.tile(np.arange(ranks), count), "host": ["h"] * (ranks * count),
        "step": np.repeat(np.arange(count), ranks),
        "duration_s": 0.5 * rng.lognormal(0, 0.05, ranks * count),
        "phase_data": 0.05 * rng.lognormal(0, 0.06, ranks * count),
        "phase_forward": 0.15 * rng.lognormal(0, 0.06, ranks * count),
    })
    report = stragglers({"steps": table, "saves": empty_saves()})
    assert report["stragglers"] == [] and report["hosts"] == []


def test_slow_saves_name_the_rank_and_phase():
    rows = []
    for checkpoint in ("a", "b", "c"):
        for rank in range(8):
            for phase, seconds in (("join", 0.5 if rank != 3 else 0.01), ("write_chunks", 1.0), ("sync", 0.2)):
                if checkpoint == "b" and rank == 5 and phase == "write_chunks":
                    seconds = 3.0
                rows.append({"name": checkpoint, "rank": rank, "host": f"h{rank // 4}", "phase": phase,
                             "duration_s": seconds * (1 + 0.01 * ((rank * 7 + len(phase)) % 5))})
    totals = {}
    for row in rows:
        totals[row["name"], row["rank"]] = totals.get((row["name"], row["rank"]), 0.0) + row["duration_s"]
    saves = pa.Table.from_pylist([{**row, "rank_total_s": totals[row["name"], row["rank"]]} for row in rows])
    report = stragglers({"steps": simulated()[0].slice(0, 0), "saves": saves})
    assert [(s["rank"], s["checkpoints"], s["phases"]) for s in report["slow_saves"]] == [(5, ["b"], ["write_chunks"])]
    assert report["slow_saves"][0]["ratio"] > 2.5  # rank 3's short join is the others' wait: not reported
