"""A run's history outlives its checkpoints (spec 4.5): removing a checkpoint (``rm``, retention, a
framework's rotation) first keeps its steps, system samples, save timing and resumes as a history
object, which gc never deletes, every analysis reads, verify checks, repair restores and sync copies."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import msgpack
import pytest
import torch

import ckptfmt
from ckptfmt import CheckpointManager, StepTimer
from ckptfmt.analytics import stragglers, tables
from ckptfmt.cli import main as cli_main
from ckptfmt.errors import CheckpointWarning
from ckptfmt.format.hashing import chunk_hash
from ckptfmt.format.history import History, HistoryKey
from ckptfmt.format.layout import HISTORY_DIR
from ckptfmt.lifecycle.gc import collect, remove
from ckptfmt.lifecycle.repair import repair
from ckptfmt.lifecycle.replicate import replicate
from ckptfmt.repository.history import history_keys, removed_histories
from ckptfmt.repository.repository import Repository
from tests.support.helpers import make_root


def train(url: str, steps: range, timer: StepTimer, every: int = 2) -> None:
    """A loop that times each step and saves every ``every`` steps with its timer."""
    for step in steps:
        with timer.step(step):
            timer.batch([step, step + 100])
            with timer.phase("forward"):
                pass
        timer.metrics(loss=1.0 / (step + 1))
        if (step + 1) % every == 0:
            ckptfmt.save({"w": torch.full((4,), float(step))}, f"{url}/step-{step + 1}", step=step + 1, timer=timer)


def step_numbers(url: str) -> list[int]:
    return sorted(tables(url)["steps"].column("step").to_pylist())


@pytest.mark.parametrize("kind", ["local", "memory", "s3"])
def test_removed_checkpoints_keep_their_steps_saves_and_samples(kind, request, tmp_path):
    url = make_root(kind, request, tmp_path)
    timer = StepTimer(system_interval="step")
    train(url, range(8), timer)
    repo = Repository.open(url)
    assert step_numbers(url) == list(range(8))
    remove(repo, ["step-2", "step-4", "step-6"])
    assert [r.name for r in repo.commits()] == ["step-8"]
    assert step_numbers(url) == list(range(8))  # before this, 2 of the 8
    built = tables(url)
    assert sorted(set(built["saves"].column("name").to_pylist())) == ["step-2", "step-4", "step-6", "step-8"]
    assert built["system"].num_rows == 8  # a sample at the end of every step
    assert built["checkpoints"].column("name").to_pylist() == ["step-8"]  # checkpoints are what is kept
    assert stragglers(url)["steps"] == 8
    assert [(k.name, k.created_ns) for k in history_keys(repo)] == [
        (r.name, r.created_ns) for r in removed_histories(repo, [])]
    collect(repo)  # gc neither deletes history objects nor calls them garbage
    assert len(history_keys(repo)) == 3 and step_numbers(url) == list(range(8))
    report = ckptfmt.verify(url)
    assert report.ok and report.histories_checked == 3 and not report.warnings


def test_rm_retention_and_a_managers_rotation_all_keep_the_history(tmp_path, capsys):
    url = str(tmp_path / "run")
    timer = StepTimer(system_interval=None)
    with CheckpointManager(url, keep_last=1) as manager:
        for step in range(6):
            with timer.step(step):
                timer.batch([step])
            manager.save(step, {"w": torch.full((3,), float(step))}, timer=timer, force=True)
    assert [r.name for r in Repository.open(url).commits()] == ["step-000000005"]
    assert step_numbers(url) == list(range(6))
    assert cli_main(["rm", f"{url}/step-000000005"]) == 0
    assert cli_main(["gc", url]) == 0
    capsys.readouterr()
    assert step_numbers(url) == list(range(6))  # the repository holds no checkpoint, and all of its history


def test_a_removal_tried_again_or_interrupted_counts_each_step_once(tmp_path):
    url = str(tmp_path / "run")
    train(url, range(4), StepTimer(system_interval=None))
    repo = Repository.open(url)
    first = repo.keep_history(repo.commit("step-2"))  # a removal killed after keeping the history
    assert step_numbers(url) == [0, 1, 2, 3]  # the checkpoint is still committed: its manifest counts
    remove(repo, ["step-2"])
    assert history_keys(repo) == [first]  # the same bytes, so the same object
    assert step_numbers(url) == [0, 1, 2, 3]


def test_a_damaged_history_object_is_reported_skipped_and_repaired_from_a_copy(tmp_path):
    url, copy = str(tmp_path / "run"), str(tmp_path / "copy")
    train(url, range(6), StepTimer(system_interval=None))
    repo = Repository.open(url)
    remove(repo, ["step-2", "step-4"])
    report = replicate(url, copy)
    assert report.histories_copied == 2 and step_numbers(copy) == list(range(6))
    key = history_keys(repo)[0]
    path = Path(url, key.key)
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))

    report = ckptfmt.verify(url)
    (problem,) = report.problems
    assert (problem.kind, problem.checkpoint, problem.key) == ("bad-history", "step-2", key.key)
    assert "hash mismatch" in problem.message and "ckptfmt repair" in problem.message
    with pytest.warns(CheckpointWarning, match="skipping a history object: .*step-2.*hash mismatch"):
        assert step_numbers(url) == [2, 3, 4, 5]
    assert cli_main(["verify", url]) == 1

    fixed = repair(url, [copy])
    assert [(fix.kind, fix.key) for fix in fixed.fixed] == [("history", key.key)] and fixed.ok
    assert step_numbers(url) == list(range(6))
    path.unlink()  # gone altogether: the copy brings it back too
    assert [fix.key for fix in repair(url, [copy]).fixed] == [key.key]


def test_a_history_object_of_another_major_version_is_reported_and_the_rest_still_read(tmp_path, capsys):
    """Issue 46: verify stopped with exit 2 at such an object instead of reporting it."""
    url = str(tmp_path / "run")
    train(url, range(6), StepTimer(system_interval=None))
    repo = Repository.open(url)
    remove(repo, ["step-2", "step-4"])
    first = history_keys(repo)[0]
    doc = msgpack.unpackb(Path(url, first.key).read_bytes())
    newer = msgpack.packb({**doc, "version": [3, 0]}, use_bin_type=True)
    Path(url, first.key).unlink()
    key = HistoryKey(first.created_ns, first.name, chunk_hash(newer))
    Path(url, key.key).write_bytes(newer)

    report = ckptfmt.verify(url)
    (problem,) = report.problems
    assert (problem.kind, problem.checkpoint, problem.key) == ("bad-history", "step-2", key.key)
    assert "upgrade" in problem.message and report.histories_checked == 2
    assert cli_main(["verify", url]) == 1
    assert "bad-history" in capsys.readouterr().out
    with pytest.warns(CheckpointWarning, match="skipping a history object: .*step-2"):
        assert step_numbers(url) == [2, 3, 4, 5]


def test_removing_a_damaged_checkpoint_goes_on_without_its_history(tmp_path):
    url = str(tmp_path / "run")
    train(url, range(4), StepTimer(system_interval=None))
    repo = Repository.open(url)
    record = repo.commit("step-2")
    manifest = Path(url, "step-2", f"manifest-{record.manifest_hash}.msgpack")
    manifest.write_bytes(manifest.read_bytes() + b"x")
    with pytest.warns(CheckpointWarning, match="removing .*step-2 without keeping its run history: .*bytes"):
        remove(repo, ["step-2"])
    assert not history_keys(repo) and step_numbers(url) == [2, 3]


def test_history_objects_are_checked_against_their_keys(tmp_path):
    url = str(tmp_path / "run")
    train(url, range(2), StepTimer(system_interval=None))
    repo = Repository.open(url)
    key = repo.keep_history(repo.commit("step-2"))
    data = Path(url, key.key).read_bytes()
    history = History.from_bytes(data, key, "here")
    assert (history.name, history.step, history.world_size) == ("step-2", 2, 1)
    assert history.to_bytes() == data  # one history, one key
    other_time = HistoryKey(key.created_ns + 1, key.name, key.digest)
    with pytest.raises(ckptfmt.ManifestError, match="here: its name and created_ns .* differ from its key's"):
        History.from_bytes(data, other_time, "here")
    with pytest.raises(ckptfmt.CorruptDataError, match="here: hash mismatch"):
        History.from_bytes(data + b"\0", key, "here")
    # Foreign entries of _history/ are ignored, as every reader ignores what it does not know (spec 4.5).
    for foreign in ("notes.txt", f".{key.key.rsplit('/', 1)[1]}.tmp-0123456789ab", "1.step-2.abc.msgpack"):
        Path(url, HISTORY_DIR, foreign).write_text("x")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert history_keys(repo) == [key]


def test_a_history_object_holds_the_members_the_spec_lists(tmp_path):
    """spec/FORMAT.md 4.5's table names every member a written history object has, in its order."""
    import msgpack

    text = (Path(__file__).parents[2] / "spec" / "FORMAT.md").read_text(encoding="utf-8")
    section = text[text.index("### 4.5 Run history"):text.index("## 5. Chunks")]
    listed = re.findall(r"^  \| `(\w+)` \|", section, re.M)
    url = str(tmp_path / "run")
    train(url, range(2), StepTimer(system_interval=None))
    repo = Repository.open(url)
    key = repo.keep_history(repo.commit("step-2"))
    doc = msgpack.unpackb(Path(url, key.key).read_bytes(), raw=False)
    assert list(doc) == listed
    assert doc["format"] == "ckptfmt-history" and tuple(doc["version"]) == ckptfmt.FORMAT_VERSION
    assert re.fullmatch(r"_history/\d{19}\.step-2\.[0-9a-f]{64}\.msgpack", key.key)
