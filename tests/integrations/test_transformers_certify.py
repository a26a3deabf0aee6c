"""``ckptfmt certify`` on real Hugging Face Trainer runs: a run stopped at a checkpoint and resumed with a
fault, each a real bug of resumes, is named with its first diverging step and cause; clean resumes are
identical.

The run of tests/support/hf_training.py (a dropout MLP, AdamW with a linear schedule, a sampler seeded
by ``data_seed``), 8 steps, a checkpoint every 2; the Trainer numbers steps from 1, so a resume from
step 4's checkpoint computes step 5 first. Faults go in as they happen: a file missing from the
checkpoint folder the Trainer resumes from (it skips what is not there), or an argument changed.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest

from tests.support.certificates import assert_diverged_at, assert_identical, assert_restored_but_not_recomputed
from tests.support.helpers import require_module

require_module("transformers", "transformers is a test dependency (pip install ckptfmt[transformers])")

from ckptfmt.analytics import certify
from ckptfmt.integrations.transformers import CkptfmtCallback
from tests.support.hf_training import Record, arguments, trainer


def train(output: Path, repo: Path, *, stop: int | None = None, resume: bool = False,
          drop: tuple[str, ...] = (), **overrides) -> None:
    """Train to step 8 (or ``stop``) saving every 2 steps into ``repo``; ``resume``: from its newest
    checkpoint, less the files named in ``drop``, with ``overrides`` of the arguments."""
    args = arguments(str(output), save_steps=2, **overrides)
    saving = CkptfmtCallback(repo)
    folder = saving.resume_folder(args) if resume else None
    for name in drop:
        os.remove(os.path.join(folder, name))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the Trainer's warnings on the files it did not find
        trainer(args, [Record(stop_at=stop), saving]).train(resume_from_checkpoint=folder)


#: case -> (the step it stops and resumes at, how it resumes, (first step, cause, evidence) or None).
CASES = {
    "clean at 2": (2, {}, None),
    "clean at 4": (4, {}, None),
    "clean at 6": (6, {}, None),
    "rng file dropped": (4, {"drop": ("rng_state.pth",)}, (5, "rng", "generator torch")),
    # the Trainer loads the optimizer and the scheduler only when both files are there
    "optimizer file dropped": (4, {"drop": ("optimizer.pt",)}, (6, "load", "optimizer missing")),
    "batches not skipped": (4, {"ignore_data_skip": True}, (5, "data", "batch of step 1 again")),
    "max_grad_norm changed": (4, {"max_grad_norm": 0.01}, (6, "hyperparameters", "max_grad_norm")),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("reference")
    train(folder / "out", folder / "repo")
    return folder / "repo"


@pytest.mark.parametrize("case", list(CASES))
def test_a_trainer_resume_is_certified_with_its_first_diverging_step_and_cause(reference, tmp_path, case):
    stop, resumed, expected = CASES[case]
    train(tmp_path / "out", tmp_path / "repo", stop=stop)
    train(tmp_path / "out", tmp_path / "repo", resume=True, **resumed)
    certificate = certify(reference, tmp_path / "repo")
    if expected is None:
        assert_identical(certificate, 8)
        (alone,) = certify(tmp_path / "repo")
        assert_restored_but_not_recomputed(alone)
        assert {part["part"]: part["verdict"] for part in alone.resume["parts"]}["data_position"] == "equal"
        return
    assert_diverged_at(certificate, *expected)
    if case == "batches not skipped":  # the resume's own record says the Trainer skipped nothing
        (alone,) = certify(tmp_path / "repo")
        assert (alone.verdict, alone.first_divergence["cause"]) == ("diverged", "load"), alone.to_json()
        assert any("consumed was 32, is 0" in line for line in alone.first_divergence["evidence"]), alone.to_json()
