"""ckptfmt.integrations.transformers against the real Hugging Face Trainer: exact resume, the same
files as the Trainer's own folder, retention, the best model, save_strategy="best", S3, every
step's timing, and a DDP run under torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from tests.support.helpers import require_module, rewrite_manifest, torchrun

require_module("transformers", "transformers is a test dependency (pip install ckptfmt[transformers])")

from safetensors.torch import load_file

import ckptfmt
from ckptfmt.analytics import Thresholds, stragglers
from ckptfmt.format import layout
from ckptfmt.integrations.transformers import CkptfmtCallback
from ckptfmt.metadata.step_timer import decode_steps
from ckptfmt.storage.factory import open_storage
from tests.support.hf_training import Record, arguments, trainer

ROOT = Path(__file__).resolve().parents[2]


def train(output_dir, callbacks: list, resume=None, **overrides):
    """Train (quietly) with tests.support.hf_training's arguments; ``resume`` is a callback whose
    resume_folder gives the checkpoint to resume from."""
    args = arguments(str(output_dir), **overrides)
    run = trainer(args, callbacks)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run.train(resume_from_checkpoint=resume.resume_folder(args) if resume else None)
    return run


def steps_of(repo) -> list[int]:
    return sorted(record.step for record in ckptfmt.Repository.open(str(repo)).commits())


def assert_same_state(expected: dict, actual: dict) -> None:
    assert expected.keys() == actual.keys()
    for key in expected:
        assert torch.equal(expected[key], actual[key]), key


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Eight steps straight through with nothing saved: the losses and the final weights."""
    record = Record()
    run = train(tmp_path_factory.mktemp("straight"), [record], save_strategy="no")
    return record.losses, run.model.state_dict()


def test_a_run_resumed_from_a_checkpoint_ends_as_an_uninterrupted_one(tmp_path, uninterrupted):
    losses, weights = uninterrupted
    first, second = Record(stop_at=4), Record()
    train(tmp_path / "out", [first, CkptfmtCallback(tmp_path / "repo")])
    assert steps_of(tmp_path / "repo") == [4]
    assert not [name for name in os.listdir(tmp_path / "out") if name.startswith("checkpoint-")]
    saving = CkptfmtCallback(tmp_path / "repo")
    run = train(tmp_path / "out", [second, saving], resume=saving)
    assert second.losses == {step: losses[step] for step in range(5, 9)}  # dropout, data order and AdamW
    assert_same_state(weights, run.model.state_dict())
    assert steps_of(tmp_path / "repo") == [4, 8]
    assert ckptfmt.verify(str(tmp_path / "repo")).ok
    # What the Trainer restored from step 4's checkpoint is on record in the next one, part by part.
    newest = max(ckptfmt.Repository.open(str(tmp_path / "repo")).commits(), key=lambda r: r.step)
    with ckptfmt.open(f"{tmp_path / 'repo'}/{newest.name}") as reader:
        (resume,) = reader.metadata["timing"]["ranks"][0]["resumes"]
    assert resume["from"]["step"] == 4
    assert {part["part"]: part["verdict"] for part in resume["parts"]} == {
        "model": "equal", "optimizer": "equal", "scheduler": "equal", "data_position": "equal"}


def test_the_resume_folder_holds_what_the_trainers_own_folder_holds(tmp_path):
    """With keep_hf_folders the Trainer writes checkpoint-4/ beside; the folder resume_folder makes
    from the ckptfmt checkpoint has the same weights, optimizer, scheduler, RNG and trainer state."""
    saving = CkptfmtCallback(tmp_path / "repo", keep_hf_folders=True)
    train(tmp_path / "out", [saving], eval_strategy="steps", eval_steps=4, metric_for_best_model="loss")
    theirs = tmp_path / "out" / "checkpoint-4"
    ours = Path(saving.resume_folder(arguments(str(tmp_path / "out")), step=4))
    assert ours == tmp_path / "out" / "ckptfmt-resume" / "checkpoint-4"
    assert_same_state(load_file(theirs / "model.safetensors"), torch.load(ours / "pytorch_model.bin"))
    for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth"):
        expected, actual = (torch.load(folder / name, weights_only=False) for folder in (theirs, ours))
        assert repr(expected) == repr(actual), name
    expected, actual = (json.loads((folder / "trainer_state.json").read_text()) for folder in (theirs, ours))
    assert expected["best_global_step"] == 4 and expected["log_history"][-1]["step"] == 4
    assert actual == expected


def test_save_total_limit_keeps_the_newest_checkpoints(tmp_path):
    saving = CkptfmtCallback(tmp_path / "repo")
    train(tmp_path / "out", [saving], save_steps=2, save_total_limit=2)
    assert steps_of(tmp_path / "repo") == [6, 8]


def test_the_best_model_is_loaded_at_the_end_as_the_trainer_does_it(tmp_path):
    """load_best_model_at_end: the model ends with the weights the Trainer's own run ends with, and
    retention keeps the best checkpoint beside the newest."""
    options = dict(eval_strategy="steps", eval_steps=2, save_steps=2, save_total_limit=1, learning_rate=0.3,
                   load_best_model_at_end=True, metric_for_best_model="loss")
    own = train(tmp_path / "own", [], **options)
    best = own.state.best_global_step
    assert best not in (None, 8)  # the case this test is about: the best is not the last
    saving = CkptfmtCallback(tmp_path / "repo")
    run = train(tmp_path / "out", [saving], **options)
    assert run.state.best_global_step == best
    assert steps_of(tmp_path / "repo") == sorted({best, 8})
    assert_same_state(own.model.state_dict(), run.model.state_dict())
    assert not os.path.exists(tmp_path / "out" / f"checkpoint-{best}")


def test_save_strategy_best_saves_each_new_best_and_no_folder(tmp_path):
    options = dict(eval_strategy="steps", eval_steps=2, save_strategy="best", learning_rate=0.3,
                   metric_for_best_model="loss")
    own = train(tmp_path / "own", [], **options)
    expected = sorted(int(name.split("-")[1]) for name in os.listdir(tmp_path / "own") if name.startswith("checkpoint"))
    assert 0 < len(expected) < 4  # some evaluations were not a new best
    train(tmp_path / "out", [CkptfmtCallback(tmp_path / "repo")], **options)
    assert steps_of(tmp_path / "repo") == expected
    assert not [name for name in os.listdir(tmp_path / "out") if name.startswith("checkpoint-")]
    assert own.state.best_global_step == expected[-1]


def test_a_run_resumes_from_s3(s3_bucket, tmp_path, uninterrupted):
    losses, weights = uninterrupted
    train(tmp_path / "out", [Record(stop_at=4), CkptfmtCallback(f"{s3_bucket}/run")])
    saving, record = CkptfmtCallback(f"{s3_bucket}/run"), Record()
    run = train(tmp_path / "out", [record, saving], resume=saving)
    assert record.losses == {step: losses[step] for step in range(5, 9)}
    assert_same_state(weights, run.model.state_dict())
    assert steps_of(f"{s3_bucket}/run") == [4, 8]


def test_every_step_is_timed_with_its_phases_and_logged_values_across_a_resume(tmp_path, uninterrupted):
    losses, _ = uninterrupted
    train(tmp_path / "out", [Record(stop_at=4), CkptfmtCallback(tmp_path / "repo")])
    saving = CkptfmtCallback(tmp_path / "repo")
    train(tmp_path / "out", [saving], resume=saving)
    numbers, logged, phases = [], [], set()
    for record in sorted(ckptfmt.Repository.open(str(tmp_path / "repo")).commits(), key=lambda r: r.step):
        with ckptfmt.open(f"{tmp_path / 'repo'}/{record.name}") as reader:
            (entry,) = reader.metadata["timing"]["ranks"]
        columns = decode_steps(entry["steps"], record.name)
        numbers += columns.step.tolist()
        logged += columns.metrics["loss"].tolist()
        assert (columns.batch_kind == 2).all() and {"torch", "numpy", "python"} <= set(columns.rng)  # signed
        phases |= set(columns.phases)
        assert (columns.duration_s > 0).all()
        total = sum(columns.phases[name] for name in columns.phases)
        assert abs(total - columns.duration_s).max() < 1e-3  # every moment of a step in one phase
    assert numbers == list(range(1, 9))  # numbered as the Trainer's log numbers them, each once
    assert logged == pytest.approx([losses[step] for step in range(1, 9)])
    assert phases == {"data", "forward_backward", "optimizer"}


def test_misspelt_options_fail_when_the_callback_is_made(tmp_path):
    with pytest.raises(TypeError, match="compresion"):
        CkptfmtCallback(tmp_path / "repo", compresion="zstd")


def test_resume_folder_is_none_on_a_fresh_start_and_names_a_missing_step(tmp_path):
    saving = CkptfmtCallback(tmp_path / "repo")
    args = arguments(str(tmp_path / "out"))
    assert saving.resume_folder(args) is None
    train(tmp_path / "out", [saving])
    with pytest.raises(ckptfmt.CheckpointError, match=r"repo: no checkpoint of step 5 \(there are \[4, 8\]\)"):
        saving.resume_folder(args, step=5)


def test_a_malformed_rng_state_is_refused_before_the_trainer_gets_it(tmp_path):
    """The Trainer sets numpy's generator from the folder's rng_state.pth, and numpy checks neither its key
    nor its position (a position of 10**6 crashed the process on the next draw); a rank names a file."""
    saving = CkptfmtCallback(tmp_path / "repo")
    args = arguments(str(tmp_path / "out"))
    train(tmp_path / "out", [saving])
    storage = open_storage(tmp_path / "repo")
    name = max(ckptfmt.Repository.open(str(tmp_path / "repo")).commits(), key=lambda record: record.step).name
    refusals = [
        (lambda rng: rng[0]["numpy"].update(pos=10**6), r"malformed RNG state of rank 0 \(numpy's pos must be"),
        (lambda rng: rng[0]["numpy"].update(keys=b""), r"malformed RNG state of rank 0 \(numpy's keys must be"),
        (lambda rng: rng[0]["python"].update(gauss_next="x"), r"rank 0 \(python's gauss_next must be a float"),
        (lambda rng: rng[0].update(torch_cpu=b"\x00" * 16), r"malformed RNG state of rank 0 \("),
        (lambda rng: rng[0].update(numpy=None), "rank 0's RNG state has no numpy state, which the Trainer restores"),
        (lambda rng: rng[0].update(rank="../../escaped"), r"an RNG state's rank must be an int >= 0, not '\.\./"),
    ]
    good = storage.read(layout.commit_key(name), max_size=2**20)
    for change, refusal in refusals:
        rewrite_manifest(storage, name, lambda doc, change=change: change(doc["rng"]))
        with pytest.raises(ckptfmt.CheckpointError, match=refusal):
            saving.resume_folder(args)
        assert not (tmp_path / "out" / "ckptfmt-resume").exists()  # refused before a file is written
        storage.write(layout.commit_key(name), good)  # the checkpoint as it was, for the next change
    assert saving.resume_folder(args) is not None


@pytest.mark.distributed
@pytest.mark.exhaustive  # 45 s of 2 ranks: make test keeps the Trainer's single-process runs
def test_a_ddp_run_saves_collectively_resumes_exactly_and_shows_the_slow_rank(tmp_path):
    """Two gloo ranks under torchrun: every checkpoint holds both ranks' steps (stragglers finds the
    rank slow to collate its batches), and a run stopped at step 8 and resumed ends with the weights
    of one that was not."""
    straight, resumed = tmp_path / "straight.pt", tmp_path / "resumed.pt"
    torchrun("transformers_ddp.py", 2, str(tmp_path / "a"), str(tmp_path / "out_a"), "16", "0", str(straight))
    with ckptfmt.open(f"{tmp_path / 'a'}/step-000000016") as reader:
        assert [entry["rank"] for entry in reader.metadata["timing"]["ranks"]] == [0, 1]
        assert reader.metadata["topology"]["world_size"] == 2
        assert [entry["rank"] for entry in reader.metadata["rng"]] == [0, 1]
    report = stragglers(str(tmp_path / "a"), thresholds=Thresholds(floor_s=0.1))
    (slow,) = report.stragglers
    (episode,) = slow.episodes  # the Trainer's loader fetches a batch ahead: some steps hold two sleeps
    assert (slow.rank, slow.phase, episode.first_step, episode.last_step) == (1, "data", 10, 13)
    assert slow.delay_s == pytest.approx(4 * 0.25, abs=0.1)
    torchrun("transformers_ddp.py", 2, str(tmp_path / "b"), str(tmp_path / "out_b"), "16", "8", str(tmp_path / "x"))
    assert steps_of(tmp_path / "b") == [8]
    torchrun("transformers_ddp.py", 2, str(tmp_path / "b"), str(tmp_path / "out_b"), "16", "0", str(resumed))
    assert_same_state(torch.load(straight), torch.load(resumed))
    assert (tmp_path / "out_b" / "ckptfmt-resume" / "checkpoint-8" / "rng_state_1.pth").exists()


def test_the_transformers_example_runs(tmp_path):
    """examples/transformers_example.py: a Trainer stopped halfway, a second one resuming."""
    example = ROOT / "examples" / "transformers_example.py"
    result = subprocess.run([sys.executable, str(example), str(tmp_path / "run")],
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines()[-3:] == [  # after the Trainer's logs
        "resumed from step 10, trained to step 20", "step-000000015: step 15", "step-000000020: step 20"]
