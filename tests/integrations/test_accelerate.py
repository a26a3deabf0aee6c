"""ckptfmt.integrations.accelerate against the real Accelerate: exact resume on 2 gloo ranks in the
middle of an epoch and on one process at an epoch's end, automatic checkpoint naming with
total_limit, every rank's steps and RNG states in the checkpoint, and the errors of misuse."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.support.certificates import assert_restored_but_not_recomputed
from tests.support.helpers import SCRIPTS, require_module, script_env, torchrun

require_module("accelerate", "accelerate is a test dependency (pip install 'ckptfmt[accelerate]')")
require_module("torchdata", "torchdata is a test dependency (its StatefulDataLoader)")

from accelerate import Accelerator, DataLoaderConfiguration

import ckptfmt
from ckptfmt import CheckpointError
from ckptfmt.analytics import Thresholds, stragglers
from ckptfmt.integrations.accelerate import StepTiming, load_state, save_state
from ckptfmt.metadata.step_timer import decode_steps

STEPS = 12


def run_alone(*args: str) -> None:
    """tests/scripts/accelerate_train.py on one process."""
    result = subprocess.run([sys.executable, str(SCRIPTS / "accelerate_train.py"), *args], capture_output=True,
                            text=True, timeout=300, env=script_env())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]


def assert_same_training_state(expected_file, actual_file) -> None:
    expected, actual = torch.load(expected_file), torch.load(actual_file)
    assert expected["model"].keys() == actual["model"].keys()
    for key in expected["model"]:
        assert torch.equal(expected["model"][key], actual["model"][key]), key
    assert expected["optimizer"]["param_groups"] == actual["optimizer"]["param_groups"]
    for index, moments in expected["optimizer"]["state"].items():
        for name, value in moments.items():
            assert torch.equal(value, actual["optimizer"]["state"][index][name]), (index, name)


@pytest.mark.distributed
@pytest.mark.exhaustive  # 40 s of 2 ranks: make test keeps the single-process save_state tests
def test_two_ranks_resume_in_the_middle_of_an_epoch_exactly_and_show_the_slow_rank(tmp_path):
    """A StatefulDataLoader and a seedable sampler: stopped after step 6 of 12 (an epoch is 4 steps on
    2 ranks) and resumed in a new process, the run ends with the weights, AdamW moments and schedule
    of one that was not; the checkpoint holds both ranks' steps and RNG states. The uninterrupted
    run's rank 1 was slow to collate batches 5..7, and its checkpoint says so."""
    straight, resumed = tmp_path / "straight.pt", tmp_path / "resumed.pt"
    torchrun("accelerate_train.py", 2, "straight", "stateful", str(tmp_path / "a"), str(STEPS), str(straight))
    report = stragglers(str(tmp_path / "a"), thresholds=Thresholds(floor_s=0.1))
    (slow,) = report.stragglers
    assert (slow.rank, slow.phase) == (1, "data")
    assert slow.delay_s == pytest.approx(3 * 0.25, abs=0.1)
    torchrun("accelerate_train.py", 2, "stop", "stateful", str(tmp_path / "run"), str(STEPS), "unused", "6")
    url = f"{tmp_path / 'run'}/step-000006"
    with ckptfmt.open(url) as reader:
        assert reader.manifest.step == 6
        assert [entry["rank"] for entry in reader.metadata["rng"]] == [0, 1]
        assert [entry["rank"] for entry in reader.metadata["timing"]["ranks"]] == [0, 1]
        steps = [decode_steps(entry["steps"], url) for entry in reader.metadata["timing"]["ranks"]]
        assert all(columns.step.tolist() == list(range(6)) for columns in steps)
        assert all(set(columns.phases) == {"data", "forward_backward", "optimizer"} for columns in steps)
        # Signed from the hooks alone: each rank's batch by the model's inputs, its own, and its generators.
        assert all((columns.batch_kind == 2).all() and {"torch", "numpy", "python"} <= set(columns.rng)
                   for columns in steps)
        assert not set(map(bytes, steps[0].batch)) & set(map(bytes, steps[1].batch))
        assert {"model_0/0.weight", "optimizer_0/state/0.weight/exp_avg"} <= set(reader.keys())
    torchrun("accelerate_train.py", 2, "resume", "stateful", url, str(STEPS), str(resumed))
    assert_same_training_state(straight, resumed)
    # Step by step on both ranks, the resumed run is the uninterrupted one, and its resume is on record.
    from ckptfmt.analytics import certify

    result = certify(str(tmp_path / "a"), str(tmp_path / "run"))
    assert (result.verdict, result.steps_compared) == ("identical", STEPS), result.to_json()
    resumes = certify(str(tmp_path / "run"))
    assert len(resumes) == 2  # each rank's, restored whole, with no step computed again to compare
    for certificate in resumes:
        assert_restored_but_not_recomputed(certificate)


@pytest.mark.distributed
@pytest.mark.exhaustive  # 40 s of 2 ranks
def test_a_resume_on_another_world_size_goes_on_at_an_epochs_end_and_is_refused_inside_one(tmp_path):
    """2 ranks (an epoch is 4 steps) resumed on one process: from the end of epoch 0 it takes the samples
    the uninterrupted 2-rank run took in epoch 1, its global batches in the same order (the seedable
    sampler's order does not depend on the world size); from inside an epoch, where each rank's
    position counts its own batches, the load is refused, the field named, and nothing is loaded."""
    reference, run = tmp_path / "reference", tmp_path / "run"
    torchrun("accelerate_train.py", 2, "straight", "plain", str(reference), "8", str(tmp_path / "a.pt"))
    torchrun("accelerate_train.py", 2, "stop", "plain", str(run), "8", "unused", "4")
    run_alone("resume", "plain", f"{run}/step-000004", "12", str(tmp_path / "b.pt"))  # epoch 1: 8 steps of 1 rank

    def batches(url: str) -> dict[int, list[bytes]]:
        with ckptfmt.open(url) as reader:
            found: dict[int, list[bytes]] = {}
            for entry in reader.metadata["timing"]["ranks"]:
                columns = decode_steps(entry["steps"], url)
                for step, digest in zip(columns.step.tolist(), map(bytes, columns.batch)):
                    found.setdefault(step, []).append(digest)  # ranks in order
            return found

    two, one = batches(f"{reference}/step-000008"), batches(f"{run}/step-000012")
    epoch_1_on_two = [digest for step in range(4, 8) for digest in two[step]]  # rank 0's batch, then rank 1's
    assert [one[step][0] for step in range(4, 12)] == epoch_1_on_two

    torchrun("accelerate_train.py", 2, "stop", "stateful", str(tmp_path / "inside"), "8", "unused", "6")
    result = subprocess.run([sys.executable, str(SCRIPTS / "accelerate_train.py"), "resume", "stateful",
                             f"{tmp_path / 'inside'}/step-000006", "12", str(tmp_path / "c.pt")],
                            capture_output=True, text=True, timeout=300, env=script_env())
    assert result.returncode != 0
    assert "dataloader_0's data position is inside epoch 1 and cannot be continued by this run: num_replicas " \
           "was 2, is 1" in result.stderr, result.stderr[-3000:]


@pytest.mark.exhaustive  # 20 s: make test keeps the single-process save_state tests
def test_automatic_naming_keeps_total_limit_and_resumes_the_newest_exactly(tmp_path):
    """One process, a plain DataLoader: saves every 2 steps as checkpoint_N (total_limit=2) until the
    epoch's end at step 8; load_state(accelerator) takes the newest and the run ends as one never stopped."""
    project = tmp_path / "project"
    run_alone("straight", "plain", str(tmp_path / "a"), str(STEPS), str(tmp_path / "straight.pt"))
    run_alone("automatic", "plain", str(project), str(STEPS), "unused", "8")
    repo = ckptfmt.Repository.open(str(project / "checkpoints"))
    assert sorted((r.name, r.step) for r in repo.commits()) == [("checkpoint_2", 6), ("checkpoint_3", 8)]
    assert ckptfmt.verify(str(project / "checkpoints")).ok  # the removed checkpoints' chunks went too
    run_alone("automatic-resume", "plain", str(project), str(STEPS), str(tmp_path / "resumed.pt"))
    assert_same_training_state(tmp_path / "straight.pt", tmp_path / "resumed.pt")


@pytest.fixture
def accelerator():
    accelerator = Accelerator(cpu=True)
    yield accelerator
    accelerator.free_memory()


def prepared(accelerator: Accelerator, width: int = 4):
    model = torch.nn.Linear(width, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return accelerator.prepare(model, optimizer)


def test_a_position_inside_an_epoch_at_another_global_batch_is_refused_and_nothing_is_loaded(tmp_path):
    data = torch.utils.data.TensorDataset(torch.arange(32.0)[:, None])
    stateful = DataLoaderConfiguration(use_stateful_dataloader=True)
    accelerator = Accelerator(cpu=True, dataloader_config=stateful)
    prepared(accelerator)
    batches = iter(accelerator.prepare(torch.utils.data.DataLoader(data, batch_size=8)))
    next(batches)  # one batch of epoch 0 handed out
    url = save_state(accelerator, tmp_path / "run" / "a")
    accelerator.free_memory()
    again = Accelerator(cpu=True, dataloader_config=stateful)
    model, _ = prepared(again)
    again.prepare(torch.utils.data.DataLoader(data, batch_size=4))
    before = model.weight.clone()
    with pytest.raises(CheckpointError, match="dataloader_0's data position is inside epoch 0 and cannot be "
                                              "continued by this run: total_batch_size was 8, is 4"):
        load_state(again, url)
    assert torch.equal(model.weight, before)
    again.free_memory()


def test_step_timing_comes_after_prepare(accelerator):
    with pytest.raises(ValueError, match=r"after accelerator\.prepare"):
        StepTiming(accelerator)


def test_without_a_url_automatic_naming_is_needed(accelerator):
    prepared(accelerator)
    with pytest.raises(ValueError, match="automatic_checkpoint_naming=True"):
        save_state(accelerator)
    with pytest.raises(ValueError, match="automatic_checkpoint_naming=True"):
        load_state(accelerator)


class Counter:
    def __init__(self):
        self.count = 0

    def state_dict(self) -> dict:
        return {"count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.count = state["count"]


def test_objects_registered_for_checkpointing_come_back(accelerator, tmp_path):
    prepared(accelerator)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    counter.count = 7
    url = save_state(accelerator, tmp_path / "run" / "a")
    counter.count = 0
    load_state(accelerator, url)
    assert counter.count == 7


def test_a_checkpoint_without_a_registered_object_is_refused_by_name_and_loads_nothing(accelerator, tmp_path):
    model, _ = prepared(accelerator)
    url = save_state(accelerator, tmp_path / "run" / "a")
    accelerator.register_for_checkpointing(Counter())
    with torch.no_grad():
        model.weight.fill_(3.0)
    with pytest.raises(ckptfmt.CheckpointError, match=r"no 'custom_0' in the checkpoint: it was saved with other "
                                                      r"prepared objects than this run's"):
        load_state(accelerator, url)
    assert (model.weight == 3.0).all()


def test_a_model_of_another_shape_is_refused(accelerator, tmp_path):
    prepared(accelerator, width=4)
    url = save_state(accelerator, tmp_path / "run" / "a")
    other = Accelerator(cpu=True)
    prepared(other, width=5)
    with pytest.raises(ckptfmt.CheckpointError, match="model_0/weight"):
        load_state(other, url)


def test_a_state_saved_on_s3_loads_back(accelerator, s3_bucket):
    model, optimizer = prepared(accelerator)
    model(torch.ones(3, 4)).sum().backward()
    optimizer.step()
    saved = {key: value.clone() for key, value in model.state_dict().items()}
    url = save_state(accelerator, f"{s3_bucket}/run/step-1")
    with torch.no_grad():
        model.weight.zero_()
    load_state(accelerator, url)
    assert all(torch.equal(saved[key], value) for key, value in model.state_dict().items())


class Forgetful(Counter):
    """A registered object whose restore is a no-op: the resume bug the record must show."""

    def load_state_dict(self, state: dict) -> None:
        pass


def test_a_load_is_on_record_with_what_it_restored_part_by_part(accelerator, tmp_path):
    from ckptfmt.metadata import resumes

    resumes._PENDING.clear()
    model = torch.nn.Linear(4, 2)
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=0.1))
    forgetful = Forgetful()
    accelerator.register_for_checkpointing(forgetful)
    model(torch.ones(3, 4)).sum().backward()
    optimizer.step()
    forgetful.count = 5
    url = save_state(accelerator, tmp_path / "run" / "a", step=1)
    forgetful.count = 0
    torch.rand(3)  # the loop draws on before the load restores the generators
    load_state(accelerator, url)
    (pending,) = resumes.pending_resumes()
    verdicts = {part["part"]: part["verdict"] for part in pending["parts"]}
    assert verdicts == {"rng": "equal", "model_0": "equal", "optimizer_0": "equal", "scaler": "equal",
                        "custom_0": "different", "accelerate_step": "equal"}
    second = save_state(accelerator, tmp_path / "run" / "b", step=2)
    with ckptfmt.open(second) as reader:
        (stored,) = reader.metadata["timing"]["ranks"][0]["resumes"]
    assert stored["from"]["name"] == "a" and stored["parts"] == pending["parts"]
    assert resumes.pending_resumes() == []


def test_a_save_right_after_a_load_keeps_the_loaders_position(tmp_path):
    """Accelerate's stateful loader answers state_dict() from a copy it refreshes as batches go out;
    after load_state it must give the loaded position (a save made at once stores it), not the old one."""
    from accelerate import DataLoaderConfiguration

    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
    try:
        model = torch.nn.Linear(4, 2)
        data = torch.utils.data.TensorDataset(torch.randn(32, 4))
        model, optimizer, loader = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                                      torch.utils.data.DataLoader(data, batch_size=4))
        batches = iter(loader)
        for _ in range(3):
            next(batches)
        url = save_state(accelerator, tmp_path / "run" / "a", step=3)
        position = ckptfmt.load(url)["dataloader_0"]["state_dict"]["_num_yielded"]
        assert position > 0
        for _ in range(2):
            next(batches)  # the loader moves on: its own copy says 5 batches now
        load_state(accelerator, url)
        again = save_state(accelerator, tmp_path / "run" / "b", step=3)
        assert ckptfmt.load(again)["dataloader_0"]["state_dict"]["_num_yielded"] == position
    finally:
        accelerator.free_memory()
