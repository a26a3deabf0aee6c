"""Jobs that save and load through ckptfmt end cleanly under torchrun, every time.

Jobs that only load (tests/scripts/load_exit_job.py: an FSDP2 model and a fresh AdamW filled in place
from a collective checkpoint, then ``destroy_process_group`` and a normal exit) too: such a job had
none of ckptfmt's exit handling and aborted at exit in 1 of 20 runs (issue 46); 20 runs in make
test-exhaustive, and in make test a check that a load under a process group sets that handling up.

Each run of tests/scripts/clean_exit_job.py loads the previous run's checkpoint on another
number of ranks (2 and 3 alternate: FSDP2 shards are resharded), saves its own
collectively, and exits normally; every fourth leaves its last asynchronous save
to ckptfmt's exit hook, and the next run loads what the hook committed. Every
torchrun must exit 0: a rank that aborts at exit ("terminate called without an
active exception") fails it. 20 runs in make test-exhaustive; 2 in make test (a resharding
load, the second leaving its save to the exit hook).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ckptfmt
from tests.support.helpers import SCRIPTS

JOB = SCRIPTS / "clean_exit_job.py"
LOAD_JOB = SCRIPTS / "load_exit_job.py"


def launch(repo: Path, run: int, last: bool) -> subprocess.CompletedProcess:
    ranks = 2 + run % 2
    pending = ["--pending"] if run % 4 == 3 or last else []
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", str(JOB),
         str(repo), str(run), *pending],
        env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=180)


@pytest.mark.parametrize("runs", [
    pytest.param(2, id="2-runs"),
    pytest.param(20, id="20-runs", marks=pytest.mark.exhaustive),
])
def test_save_reshard_load_and_exit_cleanly(tmp_path, runs):
    repo = tmp_path / "repo"
    for run in range(runs):
        result = launch(repo, run, last=run == runs - 1)
        assert result.returncode == 0, f"run {run}: exit {result.returncode}\n{result.stdout[-2000:]}\n" \
                                       f"{result.stderr[-6000:]}"
        assert "terminate called" not in result.stderr
    names = ckptfmt.Repository.open(str(repo)).names()
    assert sorted(names) == sorted([f"run-{r:03d}" for r in range(runs)] + [f"sync-{r:03d}" for r in range(runs)])
    assert ckptfmt.verify(str(repo)).ok


def torchrun(script: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(script), *args], env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True,
                          text=True, timeout=180)


@pytest.mark.exhaustive  # 20 x 2 ranks: make test keeps the check that a load sets the exit handling up
def test_jobs_that_only_load_exit_cleanly(tmp_path):
    url = str(tmp_path / "repo" / "a")
    saved = torchrun(LOAD_JOB, url, "--save")
    assert saved.returncode == 0, saved.stderr[-6000:]
    for run in range(20):
        result = torchrun(LOAD_JOB, url)
        assert result.returncode == 0, f"run {run}: exit {result.returncode}\n{result.stderr[-6000:]}"
        assert "terminate called" not in result.stderr


def load_only(rank: int, world: int, folder: Path, url: str) -> tuple[bool, bool]:
    """Whether this rank, which has only loaded, has ckptfmt's exit handling, and had it before the load."""
    from ckptfmt._teardown import registered

    before = registered()
    ckptfmt.load(url)
    return before, registered()


def test_a_load_under_a_process_group_sets_up_the_exit_handling(tmp_path):
    """Deterministically what the repeated runs above check by their exits: the load path, not only the
    save path, gives the process the handling that ends its groups before the interpreter shuts down."""
    from tests.support.ranks import run_ranks

    url = ckptfmt.save({"w": torch.ones(4)}, tmp_path / "repo" / "a")
    outcomes = [o.unwrap() for o in run_ranks(load_only, 2, tmp_path / "ranks", url=url)]
    assert outcomes == [(False, True), (False, True)]
