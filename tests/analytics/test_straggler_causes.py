"""Why ranks straggled (``ckptfmt stragglers --explain``) on a real gloo DDP run of 2 ranks, each pinned to
a core of its own: rank 0 sleeps in its data phase for a few steps, and rank 1 shares its core with CPU-bound
processes for a few others. Each episode is explained by its own cause, with evidence and an action. And on
constructed step records and samples: the share of time spent waiting for data."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pytest
import torch

import ckptfmt
from ckptfmt.analytics import Thresholds, tables
from ckptfmt.analytics.explain import explain
from ckptfmt.cli import main
from tests.support.ranks import run_ranks

STEPS, SLEEP_S = 28, 0.5
DATA_SLOW = range(5, 8)  # rank 0 sleeps in its data phase
CONTENDED = range(18, 22)  # rank 1's core is shared with HOGS CPU-bound processes
HOGS = 8
#: Each rank has a core of its own here: less noise than the 4-rank runs on 2 cores (NOISY_MACHINE).
PINNED = Thresholds(floor_s=0.1)
HOG = "import os, sys\nos.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True:\n    pass\n"


def contended_training(rank: int, world: int, folder: Path, repo: str) -> str:
    """DDP on a core of the rank's own; the slow steps described above; per-step system samples."""
    from torch.nn.parallel import DistributedDataParallel

    os.sched_setaffinity(0, {rank})
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
                                                        torch.nn.Linear(1024, 1024)))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    timer = ckptfmt.StepTimer(system_interval="step")
    generator = torch.Generator().manual_seed(rank)
    hogs: list[subprocess.Popen] = []
    url = ""
    try:
        for step in range(STEPS):
            if rank == 1 and step == CONTENDED.start:
                hogs = [subprocess.Popen([sys.executable, "-c", HOG, str(rank)]) for _ in range(HOGS)]
                time.sleep(0.2)  # the hogs are running before the step starts
            if rank == 1 and step == CONTENDED.stop:
                for hog in hogs:
                    hog.kill()
                    hog.wait()
                hogs = []
            with timer.step(step):
                with timer.phase("data"):
                    x = torch.randn(512, 1024, generator=generator)
                    if rank == 0 and step in DATA_SLOW:
                        time.sleep(SLEEP_S)
                with timer.phase("forward"):
                    loss = model(x).square().mean()
                with timer.phase("backward"):
                    optimizer.zero_grad()
                    loss.backward()
                with timer.phase("optimizer"):
                    optimizer.step()
            if step in (13, STEPS - 1):
                url = ckptfmt.save({"model": model.module.state_dict()}, f"{repo}/step-{step:04d}", step=step,
                                   timer=timer, timeout=60)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
        timer.close()
    return url


@pytest.fixture(scope="module")
def contended(tmp_path_factory) -> str:
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two cores: each rank is pinned to one of its own")
    folder = tmp_path_factory.mktemp("contended")
    repo = str(folder / "repo")
    for outcome in run_ranks(contended_training, 2, folder / "ranks", repo=repo):
        outcome.unwrap()
    return repo


def injected_episodes(repo: str) -> dict:
    """The episodes injected, as ``stragglers()`` reports them: the explanation is judged on exactly these,
    whatever the detection's sensitivity on a loaded machine (tests/analytics/test_stragglers.py judges that)."""
    return {"stragglers": [
        {"rank": 0, "host": socket.gethostname(),
         "episodes": [{"first_step": DATA_SLOW.start, "last_step": DATA_SLOW.stop - 1, "phase": "data"}]},
        {"rank": 1, "host": socket.gethostname(),
         "episodes": [{"first_step": CONTENDED.start, "last_step": CONTENDED.stop - 1, "phase": "forward"}]},
    ]}


@pytest.mark.distributed
def test_each_slow_rank_is_explained_by_its_own_cause(contended):
    built = tables(contended)
    data, cpu = explain(built, injected_episodes(contended))
    assert data["causes"][0]["cause"] == "data loading", data
    assert "rank 0 waited for its data" in data["causes"][0]["evidence"]
    assert "num_workers" in data["causes"][0]["action"]
    assert cpu["samples"] >= 2 and cpu["causes"][0]["cause"] in ("host saturated by other processes",
                                                                  "CPU contention"), cpu
    assert "its process got" in cpu["causes"][0]["evidence"]
    # Neither is blamed on the other's cause.
    assert not any(c["cause"] == "data loading" for c in cpu["causes"])
    assert not any(c["cause"] in ("CPU contention", "host saturated by other processes") for c in data["causes"])


@pytest.mark.distributed
def test_a_normal_stretch_of_steps_is_unexplained(contended):
    (quiet,) = explain(tables(contended), {"stragglers": [{"rank": 1, "host": socket.gethostname(), "episodes": [
        {"first_step": 24, "last_step": 26, "phase": "forward"}]}]})
    assert [c["cause"] for c in quiet["causes"]] == ["unexplained"]


@pytest.mark.distributed
def test_the_cli_prints_why_and_what_to_do(contended, capsys):
    """End to end: the data episode (half-second sleeps) is found on any machine, and explained."""
    assert main(["stragglers", contended, "--min-delay", str(PINNED.floor_s), "--explain"]) == 1  # found
    out = capsys.readouterr().out
    assert "why they straggled" in out and "data loading" in out and "num_workers" in out
    assert main(["stragglers", contended, "--min-delay", str(PINNED.floor_s), "--explain", "--json"]) == 1
    document = json.loads(capsys.readouterr().out)
    found = [e for e in document["explanations"] if e["rank"] == 0 and e["first_step"] in DATA_SLOW]
    assert found and found[0]["causes"][0]["cause"] == "data loading"


def data_bound_run(steps: int = 10, step_s: float = 2.0, data_s: float = 1.9) -> dict[str, pa.Table]:
    """The tables of one rank whose steps last ``step_s``, ``data_s`` of it in ``data``, sampled every second
    in the background, half a second off the step boundaries: the samples' data wait grows only when a
    step ends, by the whole step's data phase, as a StepTimer's does."""
    epoch = 1_700_000_000.0
    starts = [epoch + step_s * step for step in range(steps)]
    times = [epoch + 0.5 + second for second in range(int(step_s * steps))]
    waited = [data_s * sum(start + step_s <= time for start in starts) for time in times]

    def stamps(seconds: list[float]) -> pa.Array:
        return pa.array([round(s * 1e6) for s in seconds], pa.timestamp("us", tz="UTC"))
    return {
        "steps": pa.table({"rank": [0] * steps, "host": ["h"] * steps, "step": list(range(steps)),
                           "start": stamps(starts), "duration_s": [step_s] * steps,
                           "phase_data": [data_s] * steps, "phase_forward": [step_s - data_s] * steps}),
        "system": pa.table({"rank": [0] * len(times), "host": ["h"] * len(times), "time": stamps(times),
                            "data_wait_s": waited}),
        "saves": pa.table({"rank": pa.array([], pa.int64()), "start": stamps([]),
                           "duration_s": pa.array([], pa.float64())}),
    }


@pytest.mark.parametrize(("first", "last"), [(4, 4), (3, 6)])
def test_the_data_wait_is_a_share_of_the_steps_time_never_over_all_of_it(first, last):
    """The samples around one 2 s step hold the data phases of two steps in 3 s (127%): the share comes
    from the step records, whose data phases lie within their steps."""
    episode = {"first_step": first, "last_step": last, "phase": "data"}
    (explained,) = explain(data_bound_run(), {"stragglers": [{"rank": 0, "host": "h", "episodes": [episode]}]})
    cause = explained["causes"][0]
    assert cause["cause"] == "data loading"
    assert cause["evidence"] == "rank 0 waited for its data 95% of the time in these steps", cause
