"""Importing Hugging Face Trainer checkpoint-N folders and PyTorch Lightning .ckpt files.

The sources are written by the real tools (a tiny GPT-2 trained 3 steps by transformers'
Trainer; a tiny LightningModule trained 3 steps by Lightning's Trainer), once per module.
transformers and lightning are test dependencies only: the converters never import them.
"""

from __future__ import annotations

import glob
import json
import os
import pickle
import random
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

import ckptfmt
from ckptfmt import CheckpointError, OpaqueObject
from ckptfmt.converters import hf_trainer, import_checkpoint, lightning_format
from ckptfmt.converters.importer import SOURCES, detect_kind, read_source
from tests.support.helpers import assert_same, require_module

# --------------------------------------------------------------------------- sources, made by the real tools


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory) -> str:
    require_module("transformers")
    require_module("accelerate")
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()

    class Tokens(torch.utils.data.Dataset):
        def __init__(self):
            self.ids = torch.randint(0, 64, (16, 8), generator=torch.Generator().manual_seed(0))

        def __len__(self):
            return len(self.ids)

        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    out = tmp_path_factory.mktemp("hf") / "run"
    torch.manual_seed(0)
    config = GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=32, bos_token_id=0, eos_token_id=0)
    args = TrainingArguments(output_dir=str(out), max_steps=3, save_steps=3, save_strategy="steps",
                             per_device_train_batch_size=4, logging_steps=1, report_to=[], use_cpu=True,
                             disable_tqdm=True)
    Trainer(model=GPT2LMHeadModel(config), args=args, train_dataset=Tokens()).train()
    folder = out / "checkpoint-3"
    assert (folder / "model.safetensors").is_file() and (folder / "trainer_state.json").is_file()
    return str(folder)


@pytest.fixture(scope="module")
def lightning_ckpt(tmp_path_factory) -> str:
    L = require_module("lightning")
    import pathlib

    class Tiny(L.LightningModule):
        def __init__(self, hidden: int = 4, lr: float = 0.1, data_dir: pathlib.Path | None = None):
            super().__init__()
            self.save_hyperparameters()
            self.net = torch.nn.Linear(3, hidden)
            self.head = torch.nn.Linear(hidden, 1)

        def training_step(self, batch, _index):
            x, y = batch
            return torch.nn.functional.mse_loss(self.head(self.net(x)), y)

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
            return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)}

    root = tmp_path_factory.mktemp("lightning")
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(12, 3), torch.randn(12, 1))
    trainer = L.Trainer(max_steps=3, accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_checkpointing=True, enable_model_summary=False, default_root_dir=str(root))
    # a Path hyper-parameter: a class ckptfmt has no exact type for, so it is kept opaque
    trainer.fit(Tiny(data_dir=pathlib.PurePosixPath("/data/tiny")), torch.utils.data.DataLoader(data, batch_size=4))
    found = glob.glob(str(root / "**" / "*.ckpt"), recursive=True)
    assert len(found) == 1
    return found[0]


def _copy(folder: str, dest) -> str:
    shutil.copytree(folder, dest)
    return str(dest)


def _draws() -> tuple:
    return (torch.rand(6).tolist(), np.random.rand(6).tolist(), [random.random() for _ in range(6)],
            torch.randn(3).tolist(), np.random.randn(3).tolist(), random.gauss(0, 1))


def _scramble() -> None:
    torch.manual_seed(12345)
    np.random.seed(12345)
    random.seed(12345)


# --------------------------------------------------------------------------- Hugging Face Trainer


def test_kinds_are_registered_before_torch():
    kinds = list(SOURCES)
    assert kinds.index("hf-trainer") < kinds.index("torch") and kinds.index("lightning") < kinds.index("torch")


def test_hf_trainer_folder_imports_model_optimizer_scheduler_args(hf_checkpoint, tmp_path):
    from safetensors.torch import load_file

    assert detect_kind(hf_checkpoint) == "hf-trainer"
    assert detect_kind(os.path.join(hf_checkpoint, "trainer_state.json")) == "hf-trainer"
    assert detect_kind(os.path.join(hf_checkpoint, "optimizer.pt")) == "torch"  # single files stay themselves
    result = import_checkpoint(hf_checkpoint, tmp_path / "repo" / "hf")
    assert result.kind == "hf-trainer" and result.opaque == ["training_args"]
    loaded = ckptfmt.load(tmp_path / "repo" / "hf")
    assert list(loaded) == ["model", "optimizer", "scheduler", "training_args"]

    weights = load_file(os.path.join(hf_checkpoint, "model.safetensors"))
    assert_same(weights, loaded["model"])
    # torch.load here only to build the expected values in the test (the importer never runs pickles)
    assert_same(torch.load(os.path.join(hf_checkpoint, "optimizer.pt"), weights_only=False), loaded["optimizer"])
    assert_same(torch.load(os.path.join(hf_checkpoint, "scheduler.pt"), weights_only=False), loaded["scheduler"])
    assert loaded["optimizer"]["state"][0]["exp_avg"].abs().sum() > 0  # a real, trained state

    args = loaded["training_args"]
    assert isinstance(args, OpaqueObject) and args.qualname == "TrainingArguments"
    original = torch.load(os.path.join(hf_checkpoint, "training_args.bin"), weights_only=False)
    rebuilt = pickle.loads(args.pickle)  # kept verbatim: rebuilds where transformers is installed
    assert type(rebuilt) is type(original) and rebuilt.to_dict() == original.to_dict()

    with ckptfmt.open(tmp_path / "repo" / "hf") as reader:
        meta = reader.metadata
    assert meta["step"] == 3
    trainer_state = meta["user"]["trainer_state"]
    with open(os.path.join(hf_checkpoint, "trainer_state.json")) as f:
        expected = json.load(f)
    assert trainer_state["global_step"] == 3 and trainer_state["epoch"] == expected["epoch"]
    assert trainer_state["log_history"] == expected["log_history"] and len(trainer_state["log_history"]) == 3
    assert trainer_state["best_metric"] is None
    assert meta["user"]["config"]["n_embd"] == 16 and meta["user"]["model_weights"] == "model.safetensors"
    import transformers

    assert meta["provenance"]["versions"]["transformers"] == transformers.__version__
    assert meta["provenance"]["source_kind"] == "hf-trainer"
    assert meta["provenance"]["opaque_objects"] == ["training_args"]
    assert ckptfmt.verify(tmp_path / "repo").ok


def test_hf_trainer_rng_state_restores_like_the_trainer_would(hf_checkpoint, tmp_path):
    import_checkpoint(hf_checkpoint, tmp_path / "repo" / "hf")
    with ckptfmt.open(tmp_path / "repo" / "hf") as reader:
        entries = reader.manifest.rng
    assert [e["rank"] for e in entries] == [0] and entries[0]["cuda"] == []
    assert entries[0]["torch_initial_seed"] == 42  # the Trainer's default seed

    # What the Trainer's _load_rng_state does, applied by hand.
    saved = torch.load(os.path.join(hf_checkpoint, "rng_state.pth"), weights_only=False)
    _scramble()
    random.setstate(saved["python"])
    np.random.set_state(saved["numpy"])
    torch.set_rng_state(saved["cpu"])
    expected = _draws()

    _scramble()
    assert _draws() != expected
    _scramble()
    ckptfmt.restore_rng(tmp_path / "repo" / "hf", rank=0)
    assert _draws() == expected


@pytest.mark.parametrize("position, keys", [(10**6, 624), (-1, 624), (0, 0), (0, 625)])
def test_an_hf_numpy_state_no_restore_could_apply_is_refused_at_import(hf_checkpoint, tmp_path, position, keys):
    """numpy's set_state takes a position past its key (the next draw reads there: a crash at 10**6) and
    raises IndexError on an empty key: such a state is refused when imported, not when restored."""
    folder = _copy(hf_checkpoint, tmp_path / "checkpoint-3")
    saved = torch.load(os.path.join(folder, "rng_state.pth"), weights_only=False)
    name, _, _, has_gauss, cached = saved["numpy"]
    torch.save(dict(saved, numpy=(name, np.zeros(keys, dtype=np.uint32), position, has_gauss, cached)),
               os.path.join(folder, "rng_state.pth"))
    with pytest.raises(CheckpointError, match=r"'numpy' is not a numpy.random.get_state\(\) tuple \(numpy's"):
        read_source(folder)


def test_an_hf_python_state_no_restore_could_apply_is_refused_at_import(hf_checkpoint, tmp_path):
    """random.setstate refuses a position past the key: so does the import, not the restore."""
    folder = _copy(hf_checkpoint, tmp_path / "checkpoint-3")
    saved = torch.load(os.path.join(folder, "rng_state.pth"), weights_only=False)
    version, internal, gauss_next = saved["python"]
    torch.save(dict(saved, python=(version, (*internal[:-1], 700), gauss_next)), os.path.join(folder, "rng_state.pth"))
    with pytest.raises(CheckpointError, match=r"'python' is not a random.getstate\(\) tuple \(invalid state"):
        read_source(folder)


def test_hf_per_process_rng_files_become_ranks(hf_checkpoint, tmp_path):
    folder = _copy(hf_checkpoint, tmp_path / "checkpoint-3")
    os.rename(os.path.join(folder, "rng_state.pth"), os.path.join(folder, "rng_state_0.pth"))
    saved = torch.load(os.path.join(folder, "rng_state_0.pth"), weights_only=False)
    other = dict(saved, cpu=torch.Generator().manual_seed(7).get_state(),
                 cuda=[torch.Generator().manual_seed(8).get_state()])
    torch.save(other, os.path.join(folder, "rng_state_1.pth"))
    imported = read_source(folder)
    assert [e["rank"] for e in imported.rng] == [0, 1]
    assert imported.rng[1]["torch_cpu"] == other["cpu"].numpy().tobytes()
    assert imported.rng[1]["cuda"] == [other["cuda"][0].numpy().tobytes()]

    import_checkpoint(folder, tmp_path / "repo" / "r")
    _scramble()
    ckptfmt.restore_rng(tmp_path / "repo" / "r", rank=1)
    assert torch.get_rng_state().numpy().tobytes() == other["cpu"].numpy().tobytes()


def test_hf_folder_without_trainer_state_falls_back_to_its_name(hf_checkpoint, tmp_path):
    folder = _copy(hf_checkpoint, tmp_path / "checkpoint-3")
    os.remove(os.path.join(folder, "trainer_state.json"))
    assert detect_kind(folder) == "hf-trainer"  # optimizer.pt, training_args.bin, rng_state.pth still mark it
    result = import_checkpoint(folder, tmp_path / "repo" / "x")
    assert any("no trainer_state.json" in n for n in result.notes)
    assert any("step 3 taken from the folder name" in n for n in result.notes)
    with ckptfmt.open(tmp_path / "repo" / "x") as reader:
        assert reader.manifest.step == 3 and "trainer_state" not in reader.metadata["user"]

    renamed = _copy(folder, tmp_path / "somewhere")
    assert read_source(renamed).step is None

    weights_only = tmp_path / "weights"  # just a model folder: not a Trainer checkpoint
    weights_only.mkdir()
    shutil.copy(os.path.join(hf_checkpoint, "model.safetensors"), weights_only)
    assert detect_kind(str(weights_only)) == "safetensors"
    os.remove(os.path.join(renamed, "model.safetensors"))
    with pytest.raises(CheckpointError, match="no model weights"):
        import_checkpoint(renamed, tmp_path / "repo" / "y", kind="hf-trainer")


@pytest.mark.parametrize("damage", ["truncated", "garbage", "bad json", "bad rng"])
def test_hf_damaged_file_is_named_and_nothing_committed(hf_checkpoint, tmp_path, damage):
    folder = _copy(hf_checkpoint, tmp_path / "checkpoint-3")
    if damage == "bad rng":
        target = "rng_state.pth"
        torch.save({"cpu": torch.zeros(10, dtype=torch.uint8), "python": random.getstate()},
                   os.path.join(folder, target))
    elif damage == "bad json":
        target = "trainer_state.json"
        with open(os.path.join(folder, target), "w") as f:
            f.write("{not json")
    else:
        target = "optimizer.pt"
        path = os.path.join(folder, target)
        with open(path, "rb") as f:
            data = f.read()
        with open(path, "wb") as f:
            f.write(data[: len(data) // 2] if damage == "truncated" else b"PK\x03\x04" + os.urandom(200))
    repo = tmp_path / "repo"
    with pytest.raises(CheckpointError) as info:
        import_checkpoint(folder, repo / "x")
    assert target in str(info.value)
    assert not repo.exists() or ckptfmt.Repository.open(repo).names() == []


def test_hf_sharded_safetensors_and_pytorch_model_bin(hf_checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    weights = load_file(os.path.join(hf_checkpoint, "model.safetensors"))
    names = list(weights)
    sharded = _copy(hf_checkpoint, tmp_path / "checkpoint-3")
    os.remove(os.path.join(sharded, "model.safetensors"))
    halves = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for shard, keys in halves.items():
        save_file({k: weights[k] for k in keys}, os.path.join(sharded, shard), metadata={"format": "pt"})
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in weights.values())},
             "weight_map": {k: shard for shard, keys in halves.items() for k in keys}}
    with open(os.path.join(sharded, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)
    imported = read_source(sharded)
    assert imported.kind == "hf-trainer" and imported.metadata["model_weights"] == "model.safetensors.index.json"
    assert_same(weights, imported.state["model"])

    binned = _copy(hf_checkpoint, tmp_path / "bin" / "checkpoint-3")
    os.remove(os.path.join(binned, "model.safetensors"))
    torch.save(weights, os.path.join(binned, "pytorch_model.bin"))
    imported = read_source(binned)
    assert imported.metadata["model_weights"] == "pytorch_model.bin"
    assert_same(weights, imported.state["model"])


def test_hf_other_files_are_listed_as_not_imported(hf_checkpoint, tmp_path):
    folder = _copy(hf_checkpoint, tmp_path / "checkpoint-3")
    (tmp_path / "checkpoint-3" / "tokenizer.json").write_text("{}")
    (tmp_path / "checkpoint-3" / "global_step3").mkdir()
    scaler = {
        "scale": 65536.0,
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "growth_interval": 2000,
        "_growth_tracker": 0,
    }
    torch.save(scaler, tmp_path / "checkpoint-3" / "scaler.pt")
    imported = read_source(folder)
    assert "not imported: global_step3/, tokenizer.json" in imported.notes
    assert imported.state["scaler"] == scaler
    assert list(imported.state) == ["model", "optimizer", "scheduler", "scaler", "training_args"]


# --------------------------------------------------------------------------- Lightning


def test_lightning_ckpt_imports_type_exact(lightning_ckpt, tmp_path):
    assert detect_kind(lightning_ckpt) == "lightning"
    expected = torch.load(lightning_ckpt, weights_only=False)  # only to build the expected values
    result = import_checkpoint(lightning_ckpt, tmp_path / "repo" / "pl")
    assert result.kind == "lightning"
    loaded = ckptfmt.load(tmp_path / "repo" / "pl")
    assert list(loaded) == list(expected)
    for key in ("state_dict", "optimizer_states", "lr_schedulers", "loops", "callbacks", "epoch", "global_step",
                "pytorch-lightning_version"):
        assert_same(expected[key], loaded[key], key)
    assert loaded["optimizer_states"][0]["state"][0]["exp_avg"].abs().sum() > 0

    # the Path hyper-parameter is kept opaque, reported, and rebuilds as it was
    assert result.opaque == ["hyper_parameters/data_dir"]
    opaque = loaded["hyper_parameters"]["data_dir"]
    assert isinstance(opaque, OpaqueObject) and opaque.qualname == "PurePosixPath"
    assert pickle.loads(opaque.pickle) == expected["hyper_parameters"]["data_dir"]
    assert {k: v for k, v in loaded["hyper_parameters"].items() if k != "data_dir"} == {"hidden": 4, "lr": 0.1}

    import lightning

    with ckptfmt.open(tmp_path / "repo" / "pl") as reader:
        meta = reader.metadata
    assert meta["step"] == 3 == expected["global_step"]
    assert meta["provenance"]["versions"]["lightning"] == lightning.__version__
    assert meta["provenance"]["opaque_objects"] == ["hyper_parameters/data_dir"]
    assert meta["user"]["lightning_epoch"] == expected["epoch"]
    assert meta["rng"] == []  # Lightning keeps no RNG state in the checkpoint by default
    assert ckptfmt.verify(tmp_path / "repo").ok


def test_lightning_detection_is_specific(lightning_ckpt, tmp_path):
    plain = tmp_path / "plain.ckpt"
    torch.save({"state_dict": {"w": torch.zeros(2)}, "step": 1}, plain)
    assert not lightning_format.detect(str(plain)) and detect_kind(str(plain)) == "torch"
    with pytest.raises(CheckpointError, match="not a Lightning checkpoint"):
        read_source(str(plain), kind="lightning")
    legacy = tmp_path / "legacy.ckpt"
    torch.save(torch.load(lightning_ckpt, weights_only=False), legacy, _use_new_zipfile_serialization=False)
    assert detect_kind(str(legacy)) == "lightning" and read_source(str(legacy)).step == 3
    assert not lightning_format.detect(str(tmp_path)) and not hf_trainer.detect(str(plain))


def test_lightning_damaged_ckpt_is_named_and_nothing_committed(lightning_ckpt, tmp_path):
    with open(lightning_ckpt, "rb") as f:
        data = f.read()
    bad = tmp_path / "epoch=0-step=3.ckpt"
    bad.write_bytes(data[: len(data) - 300])
    repo = tmp_path / "repo"
    with pytest.raises(CheckpointError) as info:
        import_checkpoint(bad, repo / "x", kind="lightning")
    assert bad.name in str(info.value)
    assert not repo.exists() or ckptfmt.Repository.open(repo).names() == []


def test_converters_never_import_transformers_or_lightning(tmp_path):
    code = ("import sys; import ckptfmt.converters.hf_trainer, ckptfmt.converters.lightning_format; "
            "import ckptfmt.converters.importer as i; [i.source(k) for k in i.SOURCES]; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('transformers', 'lightning', 'pytorch_lightning', "
            "'accelerate')]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path)
