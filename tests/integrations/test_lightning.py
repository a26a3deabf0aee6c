"""ckptfmt.integrations.lightning against the real Lightning: saves, exact resume, top-k and last, S3,
asynchronous saves, a torch.save checkpoint of an earlier run, and every step's timing."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import pytest
import torch

from tests.support.helpers import require_module, torchrun

L = require_module("lightning", "Lightning is a test dependency (pip install ckptfmt[lightning])")

from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO

import ckptfmt
from ckptfmt import analytics
from ckptfmt.analytics import Thresholds, stragglers
from ckptfmt.integrations.lightning import POINTER_FORMAT, CkptfmtCheckpointIO, StepTimingCallback
from ckptfmt.lifecycle.gc import collect
from ckptfmt.metadata.step_timer import decode_steps
from ckptfmt.repository.progress import read_progress

STEPS = 8
#: Batches per epoch. A checkpoint taken at an epoch's last batch resumes exactly; in the middle of an
#: epoch, an unshuffled DataLoader cannot resume, and from an epoch-end checkpoint (every_n_epochs)
#: Lightning runs one batch more, whatever the CheckpointIO (test_lightnings_own_resume_is_exact_here).
EPOCH = 4


class Regression(L.LightningModule):
    """A small MLP trained with AdamW and a step scheduler: weights, moments and schedule all resume."""

    def __init__(self, lr: float = 0.05):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 3, 0.5)}


def loader() -> torch.utils.data.DataLoader:
    generator = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(8 * EPOCH, 8, generator=generator),
                                          torch.randn(8 * EPOCH, 1, generator=generator))
    return torch.utils.data.DataLoader(data, batch_size=8, shuffle=False)


def fit(steps: int, io, callbacks: list, ckpt_path: str | None = None) -> tuple[L.Trainer, Regression]:
    L.seed_everything(0, verbose=False)
    model = Regression()
    saves = any(isinstance(callback, ModelCheckpoint) for callback in callbacks)  # else none: not in the cwd
    trainer = L.Trainer(max_steps=steps, plugins=[io] if io is not None else [], callbacks=callbacks, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, deterministic=True,
                        accelerator="cpu", devices=1, enable_checkpointing=saves)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice on resumable data loaders and worker counts
        trainer.fit(model, loader(), ckpt_path=ckpt_path)
    return trainer, model


def final_state(trainer: L.Trainer, model: Regression) -> dict:
    return {"model": {k: v.clone() for k, v in model.state_dict().items()},
            "optimizer": trainer.optimizers[0].state_dict()}


def assert_bitwise_equal(a, b, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_bitwise_equal(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for index, (x, y) in enumerate(zip(a, b)):
            assert_bitwise_equal(x, y, f"{where}/{index}")
    else:
        assert a == b, where


def pointer(path: Path) -> str:
    document = json.loads(path.read_text())
    assert document["format"] == POINTER_FORMAT
    return document["checkpoint"]


@pytest.fixture(scope="module")
def uninterrupted() -> dict:
    """The state after STEPS steps of training with nothing saved."""
    return final_state(*fit(STEPS, None, []))


def per_epoch(folder) -> ModelCheckpoint:
    """A checkpoint at each epoch's last batch."""
    return ModelCheckpoint(dirpath=folder, every_n_train_steps=EPOCH, save_top_k=-1)


def test_lightnings_own_resume_is_exact_here(tmp_path, uninterrupted):
    """The control: the same run with Lightning's TorchCheckpointIO resumes bit-identically."""
    fit(EPOCH, None, [per_epoch(tmp_path)])
    trainer, model = fit(STEPS, None, [], ckpt_path=str(tmp_path / f"epoch=0-step={EPOCH}.ckpt"))
    assert_bitwise_equal(uninterrupted, final_state(trainer, model))


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_run_resumed_from_its_middle_ends_bit_identical(tmp_path, uninterrupted, async_save):
    folder = tmp_path / "run"
    fit(EPOCH, CkptfmtCheckpointIO(async_save=async_save), [per_epoch(folder)])
    path = folder / f"epoch=0-step={EPOCH}.ckpt"
    assert pointer(path) == f"epoch_0-step_{EPOCH}"
    trainer, model = fit(STEPS, CkptfmtCheckpointIO(async_save=async_save), [per_epoch(folder)],
                         ckpt_path=str(path))
    assert trainer.global_step == STEPS
    assert_bitwise_equal(uninterrupted, final_state(trainer, model))
    with ckptfmt.open(f"{folder}/epoch_0-step_{EPOCH}") as reader:
        assert reader.manifest.step == EPOCH
        assert reader.metadata["user"]["lightning"] == {"path": path.name, "epoch": 0, "global_step": EPOCH}
    assert ckptfmt.verify(str(folder)).ok


def test_top_k_keeps_k_checkpoints_and_their_chunks_only(tmp_path):
    """ModelCheckpoint removes what falls out of the top k through remove_checkpoint: the checkpoint
    goes, and so do the chunks no kept checkpoint uses; last.ckpt moves to each newer checkpoint."""
    folder = tmp_path / "run"
    top = ModelCheckpoint(dirpath=folder, every_n_train_steps=1, save_top_k=2, monitor="train_loss", save_last=True)
    io = CkptfmtCheckpointIO()
    trainer, _ = fit(STEPS, io, [top])
    kept_paths = {Path(p).name for p in top.best_k_models}
    assert len(kept_paths) == 2
    pointers = {entry.name for entry in folder.iterdir() if entry.name.endswith(".ckpt")}
    assert pointers == kept_paths | {"last.ckpt"}
    names = {pointer(folder / p) for p in pointers}
    assert {r.name for r in ckptfmt.Repository.open(str(folder)).commits()} == names  # nothing else kept
    assert collect(ckptfmt.Repository.open(str(folder)), dry_run=True).to_dict()["chunks"] == 0  # no garbage
    newest = ckptfmt.open(f"{folder}/{pointer(folder / 'last.ckpt')}")
    assert newest.manifest.step == trainer.global_step == STEPS
    assert ckptfmt.verify(str(folder)).ok


def test_ckpt_path_last_resumes_on_s3(s3_bucket, uninterrupted):
    """On S3 too: Lightning finds last.ckpt by listing the folder and picks the newest by its time."""
    folder = f"{s3_bucket}/run"
    io = CkptfmtCheckpointIO(storage_options={"skip_instance_cache": True})
    fit(EPOCH, io, [ModelCheckpoint(dirpath=folder, every_n_train_steps=EPOCH, save_last=True)])
    trainer, model = fit(STEPS, CkptfmtCheckpointIO(), [ModelCheckpoint(dirpath=folder, every_n_train_steps=EPOCH,
                                                                          save_last=True)], ckpt_path="last")
    assert trainer.global_step == STEPS
    assert_bitwise_equal(uninterrupted, final_state(trainer, model))
    assert ckptfmt.verify(folder).ok


def test_wrapped_in_lightnings_async_checkpoint_io(tmp_path, uninterrupted):
    folder = tmp_path / "run"
    fit(EPOCH, AsyncCheckpointIO(CkptfmtCheckpointIO()), [per_epoch(folder)])
    path = folder / f"epoch=0-step={EPOCH}.ckpt"
    trainer, model = fit(STEPS, CkptfmtCheckpointIO(), [], ckpt_path=str(path))
    assert_bitwise_equal(uninterrupted, final_state(trainer, model))


def test_a_torch_save_checkpoint_of_an_earlier_run_resumes_through_ckptfmt(tmp_path, uninterrupted):
    """A run that switches to ckptfmt resumes from the .ckpt file its previous run wrote with torch.save."""
    folder = tmp_path / "run"
    fit(EPOCH, None, [per_epoch(folder)])
    path = folder / f"epoch=0-step={EPOCH}.ckpt"
    assert path.is_file() and path.stat().st_size > 1024  # a real torch.save file
    trainer, model = fit(STEPS, CkptfmtCheckpointIO(), [ModelCheckpoint(dirpath=folder / "ckptfmt")],
                         ckpt_path=str(path))
    assert_bitwise_equal(uninterrupted, final_state(trainer, model))


def test_every_step_is_timed_with_its_phases_and_numbered_across_a_resume(tmp_path):
    folder = tmp_path / "run"
    fit(EPOCH, CkptfmtCheckpointIO(), [ModelCheckpoint(dirpath=folder, every_n_train_steps=2, save_top_k=-1),
                                       StepTimingCallback()])
    fit(STEPS, CkptfmtCheckpointIO(), [ModelCheckpoint(dirpath=folder, every_n_train_steps=2, save_top_k=-1),
                                       StepTimingCallback()], ckpt_path=str(folder / f"epoch=0-step={EPOCH}.ckpt"))
    numbers, phases = [], set()
    for record in sorted(ckptfmt.Repository.open(str(folder)).commits(), key=lambda r: r.step):
        with ckptfmt.open(f"{folder}/{record.name}") as reader:
            (entry,) = reader.metadata["timing"]["ranks"]
        columns = decode_steps(entry["steps"], record.name)
        numbers += columns.step.tolist()
        phases |= set(columns.phases)
        assert columns.metrics["global_step"].tolist() == [float(s) for s in columns.step.tolist()]
        assert (columns.duration_s > 0).all()
        total = sum(columns.phases[name] for name in columns.phases)
        assert abs(total - columns.duration_s).max() < 1e-3  # every moment of a step in one phase
    assert numbers == list(range(STEPS))  # each step once, in order, across the resume
    assert phases == {"data", "forward_backward", "optimizer"}


def test_the_steps_of_checkpoints_top_k_removed_stay_in_the_runs_history(tmp_path):
    """The issue's case: save_top_k=2, resumed once. Before history objects (spec 4.5) ``stragglers``
    saw only the steps that the two kept checkpoints and the last one held."""
    folder = tmp_path / "run"

    def callbacks() -> list:
        return [ModelCheckpoint(dirpath=folder, every_n_train_steps=1, save_top_k=2, monitor="train_loss",
                                save_last=True), StepTimingCallback()]
    fit(EPOCH, CkptfmtCheckpointIO(), callbacks())
    fit(STEPS, CkptfmtCheckpointIO(), callbacks(), ckpt_path="last")
    repo = ckptfmt.Repository.open(str(folder))
    assert len(repo.commits()) <= 3  # the top 2 and last
    built = analytics.tables(str(folder))
    assert sorted(built["steps"].column("step").to_pylist()) == list(range(STEPS))
    assert sorted(built["saves"].column("step").unique().to_pylist()) == list(range(1, STEPS + 1))
    assert stragglers(str(folder))["steps"] == STEPS
    copy = tmp_path / "copy"
    ckptfmt.replicate(str(folder), str(copy))
    assert stragglers(str(copy))["steps"] == STEPS


def signatures(folder) -> dict[int, tuple]:
    """Each recorded step's signature: (batch kind, batch digest, loss bits, generator names)."""
    found = {}
    for record in ckptfmt.Repository.open(str(folder)).commits():
        with ckptfmt.open(f"{folder}/{record.name}") as reader:
            (entry,) = reader.metadata["timing"]["ranks"]
        columns = decode_steps(entry["steps"], record.name)
        for row, step in enumerate(columns.step.tolist()):
            found[step] = (int(columns.batch_kind[row]), bytes(columns.batch[row]),
                           columns.metrics["loss"][row].tobytes(), tuple(sorted(columns.rng)))
    return found


def test_every_step_is_signed_and_a_resumed_runs_steps_sign_as_the_straight_runs(tmp_path):
    """The callback signs each step with no user code: the batch Lightning hands it (by its tensors),
    the generators at its start and the loss's bits; the steps after an exact resume sign as the
    uninterrupted run's do."""
    straight, cut = tmp_path / "straight", tmp_path / "cut"

    def saving(folder):
        return [ModelCheckpoint(dirpath=folder, every_n_train_steps=2, save_top_k=-1), StepTimingCallback()]
    fit(STEPS, CkptfmtCheckpointIO(), saving(straight))
    fit(EPOCH, CkptfmtCheckpointIO(), saving(cut))
    fit(STEPS, CkptfmtCheckpointIO(), saving(cut), ckpt_path=str(cut / f"epoch=0-step={EPOCH}.ckpt"))
    expected, resumed = signatures(straight), signatures(cut)
    assert sorted(expected) == sorted(resumed) == list(range(STEPS))
    assert {signature[0] for signature in expected.values()} == {2}  # the batch's tensors
    assert {signature[3] for signature in expected.values()} == {("numpy", "python", "torch")}
    assert len({signature[1] for signature in expected.values()}) == EPOCH  # an epoch's batches, twice
    for step in range(STEPS):
        assert expected[step] == resumed[step], step


class DropOptimizerState(L.Callback):
    """A resume bug: the optimizer's restored moments are thrown away before training starts."""

    def on_train_start(self, trainer, pl_module):
        trainer.optimizers[0].state.clear()


@pytest.mark.parametrize("fault", [None, "dropped"])
def test_a_resume_is_on_record_with_what_it_restored(tmp_path, fault):
    folder = tmp_path / "run"

    def callbacks():
        return [ModelCheckpoint(dirpath=folder, every_n_train_steps=EPOCH, save_top_k=-1), StepTimingCallback()]
    fit(EPOCH, CkptfmtCheckpointIO(), callbacks())
    fit(STEPS, CkptfmtCheckpointIO(), ([DropOptimizerState()] if fault else []) + callbacks(),
        ckpt_path=str(folder / f"epoch=0-step={EPOCH}.ckpt"))
    with ckptfmt.open(f"{folder}/{pointer(folder / f'epoch=1-step={STEPS}.ckpt')}") as reader:
        (entry,) = reader.metadata["timing"]["ranks"]
    (resume,) = entry["resumes"]
    assert (resume["from"]["name"], resume["from"]["step"]) == (f"epoch_0-step_{EPOCH}", EPOCH)
    parts = {part["part"]: part for part in resume["parts"]}
    assert parts["state_dict"]["verdict"] == parts["lr_schedulers"]["verdict"] == "equal"
    if fault is None:
        assert parts["optimizer_states"]["verdict"] == "equal"
    else:
        assert parts["optimizer_states"]["verdict"] == "missing"
        assert "optimizer_states/0/state/0/exp_avg" in parts["optimizer_states"]["keys"]


def test_misspelt_and_managed_options_fail_when_the_plugin_is_made():
    with pytest.raises(TypeError, match=r"^CkptfmtCheckpointIO\(\) got an unexpected keyword argument 'compresion'$"):
        CkptfmtCheckpointIO(compresion="zstd")
    with pytest.raises(TypeError, match="CkptfmtCheckpointIO sets 'step' itself"):
        CkptfmtCheckpointIO(step=3)


def test_loading_a_path_with_nothing_there_names_it(tmp_path):
    (tmp_path / "run").mkdir()
    with pytest.raises(ckptfmt.CheckpointNotFoundError, match=r"run/missing\.ckpt: no checkpoint there"):
        CkptfmtCheckpointIO().load_checkpoint(tmp_path / "run" / "missing.ckpt")


def test_a_checkpoint_url_itself_loads(tmp_path):
    ckptfmt.save({"w": torch.ones(3), "epoch": 2}, tmp_path / "run" / "plain")
    loaded = CkptfmtCheckpointIO().load_checkpoint(os.fspath(tmp_path / "run" / "plain"))
    assert loaded["epoch"] == 2 and torch.equal(loaded["w"], torch.ones(3))


@pytest.mark.distributed
def test_a_ddp_run_saved_by_rank_zero_holds_every_ranks_steps_and_finds_the_slow_one(tmp_path):
    """Lightning writes from rank 0 alone; the callback gathers both ranks' steps into each checkpoint,
    so ckptfmt stragglers finds the rank that was slow to fetch its batches; the 2 steps after the last
    checkpoint are in each rank's progress object, where goodput reads them."""
    repo = tmp_path / "run"
    result = torchrun("lightning_ddp.py", 2, str(repo), "26", "1", "10", "13")
    assert "terminate called" not in result.stderr
    records = sorted(ckptfmt.Repository.open(str(repo)).commits(), key=lambda r: r.step)
    assert [r.step for r in records] == [8, 16, 24]
    with ckptfmt.open(f"{repo}/{records[-1].name}") as reader:
        assert [entry["rank"] for entry in reader.metadata["timing"]["ranks"]] == [0, 1]
        assert reader.metadata["topology"]["writer_ranks"] == [0]
    report = stragglers(str(repo), thresholds=Thresholds(floor_s=0.1))
    found = {(s.rank, step) for s in report.stragglers for step in s.steps}
    assert found == {(1, step) for step in range(10, 14)}, report.stragglers
    assert {progress.rank for progress in read_progress(ckptfmt.Repository.open(str(repo)))} == {0, 1}
    time_spent = analytics.goodput(str(repo))
    assert (time_spent.ranks, time_spent.steps_kept) == (2, 26)


@pytest.mark.distributed
@pytest.mark.exhaustive  # 50 s of 2 ranks: make test keeps the DDP run
def test_the_sharded_strategy_saves_collectively_and_resumes_bit_identical(tmp_path):
    """FSDP2 through Lightning's ModelParallelStrategy on 2 gloo ranks: each rank writes its shards of
    one checkpoint; a run resumed from its middle ends with the weights and AdamW state of an
    uninterrupted one."""
    repo, straight, resumed = tmp_path / "run", tmp_path / "straight.pt", tmp_path / "resumed.pt"
    torchrun("lightning_model_parallel.py", 2, str(tmp_path / "unused"), str(STEPS), str(straight))
    torchrun("lightning_model_parallel.py", 2, str(repo), str(EPOCH), str(tmp_path / "half.pt"))
    path = repo / f"epoch=0-step={EPOCH}.ckpt"
    name = pointer(path)
    with ckptfmt.open(f"{repo}/{name}") as reader:
        weight = reader.tensor_info("state_dict/net.0.weight")
        assert {shard.rank for shard in weight.shards} == {0, 1}  # each rank wrote its own shard
        assert reader.metadata["topology"]["world_size"] == 2
        assert [entry["rank"] for entry in reader.metadata["timing"]["ranks"]] == [0, 1]
        assert all(decode_steps(entry["steps"], name).count == EPOCH for entry in reader.metadata["timing"]["ranks"])
    torchrun("lightning_model_parallel.py", 2, str(repo), str(STEPS), str(resumed), str(path))
    assert_bitwise_equal(torch.load(straight), torch.load(resumed))
    assert ckptfmt.verify(str(repo)).ok


def test_the_lightning_example_runs(tmp_path):
    """examples/lightning_example.py: two Trainers, the second resuming from last.ckpt."""
    import subprocess
    import sys

    example = Path(__file__).resolve().parents[2] / "examples" / "lightning_example.py"
    result = subprocess.run([sys.executable, str(example), str(tmp_path / "run"), "--steps", "20"],
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[0] == "trained to step 40, resumed from step 20"
    kept = {line.split(":")[0] for line in lines[1:]}
    assert len(kept) == 3 and "last" in {name.split("-")[0] for name in kept}  # two best and last
