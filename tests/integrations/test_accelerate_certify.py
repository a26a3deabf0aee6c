"""``ckptfmt certify`` on real Accelerate runs: a run stopped at a checkpoint and resumed with a fault, each
a real bug of resumes, is named with its first diverging step and cause; clean resumes are identical.

The loop of tests/scripts/accelerate_train.py on one process (a dropout MLP, AdamW, StepLR stepped every
step, Accelerate's seedable sampler: 8 steps an epoch), 12 steps; the reference saves once at its end,
holding every step's signature. Faults go in right after ``load_state``, as the loop's own code would
put them: the models, optimizers and schedulers are on record as the first step after the load finds
them.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.certificates import assert_diverged_at, assert_identical, assert_restored_but_not_recomputed
from tests.support.helpers import SCRIPTS, require_module, script_env

require_module("accelerate", "Accelerate is a test dependency (pip install ckptfmt[accelerate])")

from ckptfmt.analytics import certify

STEPS = 12


def run(*args: str) -> None:
    result = subprocess.run([sys.executable, str(SCRIPTS / "accelerate_train.py"), *args], capture_output=True,
                            text=True, timeout=300, env=script_env())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]


#: case -> (loader, the step it stops and resumes at, the fault, (first step, cause, evidence) or None).
CASES = {
    "clean mid-epoch (a stateful loader)": ("stateful", 4, None, None),
    "clean at the epoch's end": ("plain", 8, None, None),
    # A plain DataLoader has no position within an epoch: Accelerate's load leaves it at the epoch's start.
    "batches not skipped": ("plain", 4, None, (4, "data", "batch")),
    "seeded again after the load": ("plain", 8, "reseeded", (8, "rng", "generator torch")),
    "optimizer state dropped": ("plain", 8, "optimizer", (9, "load", "optimizer_0 different")),
    "schedule reset": ("plain", 8, "scheduler", (10, "load", "scheduler_0 different")),
    "loss perturbed": ("plain", 8, "perturbed", (8, "nondeterminism", "agree")),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """The reference, and each loader's run stopped at each case's step (a case resumes a copy)."""
    folder = tmp_path_factory.mktemp("accelerate")
    run("straight", "plain", str(folder / "reference"), str(STEPS), str(folder / "reference.pt"))
    for loader, stop in {(loader, stop) for loader, stop, _, _ in CASES.values()}:
        run("stop", loader, str(folder / f"{loader}-{stop}"), str(STEPS), "unused", str(stop))
    return folder


#: Cases left to the exhaustive suite (make test keeps a clean resume and a fault of each kind of cause
#: found by the steps' signatures and by the resume's record).
EXHAUSTIVE = {"clean at the epoch's end", "seeded again after the load", "schedule reset"}


@pytest.mark.parametrize("case", [pytest.param(case, marks=pytest.mark.exhaustive) if case in EXHAUSTIVE else case
                                  for case in CASES])
def test_an_accelerate_resume_is_certified_with_its_first_diverging_step_and_cause(runs, tmp_path, case):
    loader, stop, fault, expected = CASES[case]
    repo = tmp_path / "run"
    shutil.copytree(runs / f"{loader}-{stop}", repo)
    faults = [fault] if fault else []
    run("resume", loader, f"{repo}/step-{stop:06d}", str(STEPS), str(tmp_path / "out.pt"), "0", *faults)
    certificate = certify(runs / "reference", repo)
    (alone,) = certify(repo)
    if expected is None:
        assert_identical(certificate, STEPS)
        assert_restored_but_not_recomputed(alone)
        return
    step, cause, named = expected
    assert_diverged_at(certificate, step, cause, named)
    # A part the resume left otherwise is on the resume's own record: no reference needed to see it.
    assert (alone.verdict == "diverged") == (cause == "load"), alone.to_json()
