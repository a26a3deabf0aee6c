"""ckptfmt.integrations.torchtitan against the real torchtitan: its checkpoint manager contract
driven as torchtitan's Trainer drives it (tests/scripts/torchtitan_manager.py, 2 gloo ranks, FSDP2),
with torchtitan's own Config, optimizer, scheduler and data loader classes. Resume is exact,
keep_latest_k, load_step, exclude_from_loading, last_save_model_only with export_dtype and
initial_load_path (ckptfmt's and a DCP folder of torchtitan's own manager) do what torchtitan's
manager does, every rank's steps are in the checkpoints, and misuse is refused."""

from __future__ import annotations

import json

import pytest
import torch

from tests.support.helpers import require_module, torchrun

require_module("torchtitan", "torchtitan is a test dependency (pip install --no-deps torchtitan, see docs)")

import ckptfmt
from ckptfmt import CheckpointNotFoundError
from ckptfmt.analytics import stragglers
from ckptfmt.integrations.torchtitan import CkptfmtCheckpointManager
from ckptfmt.metadata.step_timer import decode_steps

pytestmark = pytest.mark.distributed


def train(out, steps: int, stop: int | None = None, **config) -> dict:
    """One torchrun of the driver; its rank 0's result."""
    out.mkdir(parents=True, exist_ok=True)
    torchrun("torchtitan_manager.py", 2, str(out), json.dumps({"enable": True, **config}), str(steps),
             *([str(stop)] if stop is not None else []))
    return torch.load(out / "result.pt")


def assert_same_state(expected: dict, actual: dict) -> None:
    for key, value in expected["params"].items():
        assert torch.equal(value, actual["params"][key]), key
    assert expected["optimizer"].keys() == actual["optimizer"].keys()
    for key, value in expected["optimizer"].items():
        assert torch.equal(value, actual["optimizer"][key]) if isinstance(value, torch.Tensor) \
            else value == actual["optimizer"][key], key


def test_a_cut_run_resumes_exactly_keeps_the_latest_k_and_records_every_ranks_steps(tmp_path):
    # A dataset without state_dict, which torchdata's loader resumes by fast-forwarding (see below).
    options = {"interval": 2, "keep_latest_k": 2, "last_save_model_only": False, "async_mode": "async",
               "stateless_data": True}
    straight = train(tmp_path / "straight", 6, folder=str(tmp_path / "straight-repo"), **options)
    cut = train(tmp_path / "cut", 6, 4, folder=str(tmp_path / "repo"), **options)
    assert (cut["started"], cut["loaded"], len(cut["losses"])) == (0, False, 4)
    resumed = train(tmp_path / "resumed", 6, folder=str(tmp_path / "repo"), **options)
    assert (resumed["started"], resumed["loaded"]) == (4, True)
    assert resumed["losses"] == straight["losses"][4:]  # dropout's RNG and the data position go on
    assert_same_state(straight, resumed)

    repo = ckptfmt.Repository.open(str(tmp_path / "repo"))
    assert sorted(repo.names()) == ["step-4", "step-6"]  # keep_latest_k=2 removed step-2
    with ckptfmt.open(str(tmp_path / "repo/step-6")) as reader:
        state = reader.load_state()
        assert state["train_state"] == {"step": 6, "ntokens_seen": 6 * 4 * 16}
        assert set(state["dataloader"]) == {0, 1}  # each rank's position
        assert set(state) == {"model", "optimizer", "lr_scheduler", "dataloader", "train_state", "job_config"}
        assert state["job_config"]["hyperparameters"]["training.max_norm"] == 0.02  # the trainer's settings
        ranks = reader.metadata["timing"]["ranks"]
        assert [entry["rank"] for entry in ranks] == [0, 1]
        for entry in ranks:  # the resume from step 4, on record on each rank with what it restored
            (resume,) = [r for r in entry.get("resumes", [])]
            assert (resume["from"]["name"], resume["rank"], resume["world_size"]) == ("step-4", entry["rank"], [2, 2])
            verdicts = {part["part"]: part["verdict"] for part in resume["parts"]}
            assert verdicts == {**dict.fromkeys(["model", "optimizer", "lr_scheduler", "train_state"], "equal"),
                                "dataloader": "different"}, resume["parts"]
            # A real fault, found by the check: torchdata's StatefulDataLoader, resumed by fast-forwarding an
            # IterableDataset without a state_dict, counts the batches it skipped twice (restored position 2,
            # reported 4): this run goes on right, and a second resume skips batches (test_torchtitan_certify.py).
        for entry in ranks:  # the resumed process's steps, numbered as torchtitan numbers them
            columns = decode_steps(entry["steps"], "step-6")
            assert columns.step.tolist() == [5, 6]
            assert list(columns.phases) == ["data", "forward_backward", "optimizer"]
    assert stragglers(str(tmp_path / "repo"))["ranks"] == 2


@pytest.mark.exhaustive  # 35 s of ranks: make test keeps the cut-and-resumed run
def test_the_last_save_is_the_model_alone_in_export_dtype_and_load_step_exclusions_hold(tmp_path):
    repo = tmp_path / "repo"
    first = train(tmp_path / "first", 4, folder=str(repo), interval=2, export_dtype="bfloat16")
    with ckptfmt.open(str(repo / "step-4")) as last:
        assert set(last.load_state()) == {"model"}
        assert {last.tensor_info(key).dtype for key in last.keys()} == {"bfloat16"}
    with ckptfmt.open(str(repo / "step-2")) as full:
        assert {"optimizer", "dataloader", "train_state"} <= set(full.load_state())
    # load_step=2 and no data loader position: the run goes on from step 2, its data from the start
    again = train(tmp_path / "again", 4, folder=str(repo), load_step=2, exclude_from_loading=["dataloader"],
                  load_only=True)
    assert (again["started"], again["loaded"]) == (2, True)
    assert again["losses"] != first["losses"][2:]  # other batches than the first run's steps 3 and 4
    # the newest checkpoint is model-only: the model alone is loaded (bf16 into float32 refused)
    with pytest.raises(AssertionError, match="bfloat16|dtype"):
        train(tmp_path / "model-only", 4, folder=str(repo), load_only=True)


@pytest.mark.exhaustive  # 45 s of ranks: make test keeps the cut-and-resumed run
def test_initial_load_path_reads_a_ckptfmt_checkpoint_or_torchtitans_own_dcp_folder(tmp_path):
    options = {"interval": 2, "last_save_model_only": False}
    dcp_run = train(tmp_path / "dcp", 2, folder=str(tmp_path / "dcp-folder"), torchtitan_dcp=True, **options)
    from_dcp = train(tmp_path / "from-dcp", 2, folder=str(tmp_path / "repo-a"), initial_load_model_only=False,
                     initial_load_path=str(tmp_path / "dcp-folder/step-2"), **options)
    assert (from_dcp["started"], from_dcp["loaded"], from_dcp["losses"]) == (2, True, [])
    assert_same_state(dcp_run, from_dcp)

    ours = train(tmp_path / "ours", 2, folder=str(tmp_path / "repo-b"), **options)
    model_only = train(tmp_path / "model-only", 0, folder=str(tmp_path / "repo-c"),
                       initial_load_path=str(tmp_path / "repo-b/step-2"))
    assert (model_only["started"], model_only["loaded"]) == (0, True)
    for key, value in ours["params"].items():
        assert torch.equal(value, model_only["params"][key]), key


def test_misuse_is_refused_with_a_clear_message(tmp_path):
    with pytest.raises(ValueError, match="last_save_in_hf is not supported"):
        CkptfmtCheckpointManager.Config(enable=True, last_save_in_hf=True)
    with pytest.raises(ValueError, match="Invalid async_mode"):
        CkptfmtCheckpointManager.Config(enable=True, async_mode="sometimes")
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
    from torchtitan.components.optimizer.optimizer import OptimizersContainer, ParamGroupConfig

    model = torch.nn.Linear(3, 2)
    optimizers = OptimizersContainer.Config(
        implementation="for-loop",
        param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 0.1})],
    ).build(model_parts=[model])
    manager = CkptfmtCheckpointManager.Config(enable=True, folder=str(tmp_path / "repo")).build(
        dataloader=None, model_parts=[model], optimizers=optimizers,
        lr_schedulers=LRSchedulersContainer.Config().build(optimizers=optimizers, training_steps=4),
        states={}, sd_adapter=None)
    assert manager.load() is False  # a fresh start
    with pytest.raises(CheckpointNotFoundError, match="load_step=3: no step-3"):
        manager.load(step=3)
    manager.close()
    disabled = CkptfmtCheckpointManager.Config(enable=False).build(
        dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=None, states={}, sd_adapter=None)
    assert disabled.save(1, last_step=True) is False and not (tmp_path / "checkpoint").exists()
