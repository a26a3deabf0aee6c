"""Jobs that save and load through ckptfmt end cleanly under torchrun, every time.

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

import ckptfmt
from tests.support.helpers import SCRIPTS

JOB = SCRIPTS / "clean_exit_job.py"


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
