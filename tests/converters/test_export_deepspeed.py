"""Export to DeepSpeed ZeRO folders for another world size, loaded back by the real DeepSpeed (CPU, gloo).

One torchrun of 2 ranks trains and saves ZeRO-1/2/3 checkpoints (fp32 and bf16) with
tests/deepspeed_roundtrip.py; they are imported, exported for 3, 2 and 1 ranks (some to
another stage), and each export is loaded by DeepSpeed's own ``engine.load_checkpoint`` on
that many ranks, which then trains one more step. What the loading engine holds (fp32
master weights, Adam moments, module weights, scheduler, step) must equal, bit for bit, what
the saving engine held.
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.helpers import assert_bits, deepspeed_torchrun, require_module

#: 19 DeepSpeed runs on 1 to 3 ranks, over a minute: make test-exhaustive (and .ci/run) runs them.
pytestmark = [pytest.mark.deepspeed, pytest.mark.distributed, pytest.mark.slow, pytest.mark.exhaustive]
require_module("deepspeed", "DeepSpeed is not installed (a test-only dependency: "
               "DS_BUILD_OPS=0 pip install -c constraints-dev.txt deepspeed)")

from safetensors.torch import load_file

import ckptfmt
from ckptfmt import CheckpointError
from ckptfmt.converters import import_checkpoint
from ckptfmt.converters.deepspeed_export import _ZERO_STAGE_PICKLE
from ckptfmt.converters.export import export_checkpoint
from ckptfmt.converters.importer import read_source

SAVED = {"z1-fp32": (1, "fp32"), "z2-bf16": (2, "bf16"), "z3-fp32": (3, "fp32"), "z3-bf16": (3, "bf16"),
         "z2-elastic": (2, "fp32-elastic"), "z2-fp16": (2, "fp16")}
#: export name -> (source, world size, stage, dtype the loading run uses)
EXPORTS = {
    "z1-fp32-to-3": ("z1-fp32", 3, 1, "fp32"),
    "z2-bf16-to-3": ("z2-bf16", 3, 2, "bf16"),
    "z3-fp32-to-3": ("z3-fp32", 3, 3, "fp32"),
    "z3-bf16-to-3": ("z3-bf16", 3, 3, "bf16"),
    "z2-bf16-to-3-stage3": ("z2-bf16", 3, 3, "bf16"),
    "z3-fp32-to-3-stage1": ("z3-fp32", 3, 1, "fp32"),
    "z2-bf16-to-2": ("z2-bf16", 2, 2, "bf16"),
    "z3-bf16-to-1-stage2": ("z3-bf16", 1, 2, "bf16"),
    "z2-elastic-to-3": ("z2-elastic", 3, 2, "fp32-elastic"),  # no param_groups recorded: the elastic layout
    "z2-fp16-to-3-stage3": ("z2-fp16", 3, 3, "fp16"),  # fp16 weights and DeepSpeed's dynamic loss scaler
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """Saved by DeepSpeed on 2 ranks, imported, exported, and loaded back by DeepSpeed on 3, 2 and 1 ranks."""
    out = tmp_path_factory.mktemp("deepspeed-export")
    deepspeed_torchrun("deepspeed_roundtrip.py", 2, "save", str(out),
                       *(f"{name}:{stage}:{dtype}" for name, (stage, dtype) in SAVED.items()))
    for name in SAVED:
        import_checkpoint(out / name, out / "repo" / name)
    for name, (source, world, stage, _) in EXPORTS.items():
        export_checkpoint(out / "repo" / source, out / name, format="deepspeed", world_size=world, zero_stage=stage)
    for world in (3, 2, 1):
        specs = [f"{name}:{stage}:{dtype}" for name, (_, w, stage, dtype) in EXPORTS.items() if w == world]
        if world == 2:
            specs.append("z2-bf16:2:bf16")  # DeepSpeed loading its own folder: the reference for the next step
        deepspeed_torchrun("deepspeed_roundtrip.py", world, "load", str(out), *specs)
    return out


def state(runs: Path, name: str) -> dict:
    return torch.load(runs / f"{name}.state.pt", weights_only=False)


@pytest.mark.parametrize("name", list(EXPORTS))
def test_deepspeed_loads_the_export_bit_for_bit(runs, name):
    source, world, stage, _ = EXPORTS[name]
    saved, loaded = state(runs, source), state(runs, name)
    for key in ("fp32", "exp_avg", "exp_avg_sq"):
        assert list(loaded[key]) == list(saved[key])
        for param, tensor in saved[key].items():
            assert_bits(loaded[key][param], tensor, f"{key}/{param}")
    assert list(loaded["module"]) == list(saved["module"])  # incl. the frozen layer, buffer and tied head
    for param, tensor in saved["module"].items():
        assert_bits(loaded["module"][param], tensor, f"module/{param}")
    assert loaded["global_steps"] == saved["global_steps"] == 3
    assert loaded["lr_scheduler"] == saved["lr_scheduler"]
    if source != "z2-elastic":  # an elastic checkpoint records no hyper-parameters: lr comes from the loading run
        assert loaded["lr"] == saved["lr"]
    assert loaded["client_state"]["epoch"] == 1 and loaded["client_state"]["note"] == "tiny"
    assert loaded["client_state"]["ds_config"]["zero_optimization"]["stage"] == stage
    assert torch.isfinite(torch.tensor(loaded["next_loss"]))
    folder = runs / name / "global_step3"
    prefix = "bf16_" if source.endswith("bf16") else ""
    assert sorted(p.name for p in folder.glob("*optim_states.pt")) == \
        sorted(f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(world))


def test_next_step_equals_deepspeeds_own_resume(runs):
    """Same world size: resuming from the export trains exactly as resuming from DeepSpeed's own folder."""
    native, exported = state(runs, "z2-bf16"), state(runs, "z2-bf16-to-2")
    assert exported["next_loss"] == native["next_loss"]
    for param, tensor in native["after"].items():
        assert_bits(exported["after"][param], tensor, param)


@pytest.mark.parametrize("name", ["z2-bf16-to-3", "z3-bf16-to-3", "z3-fp32-to-3-stage1"])
def test_zero_to_fp32_reads_the_export(runs, name):
    """DeepSpeed's zero_to_fp32 rebuilds the same weights from the export as from the original folder,
    and the consolidated model.safetensors beside it is exactly that."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    source = EXPORTS[name][0]
    with contextlib.redirect_stdout(io.StringIO()):
        reference = get_fp32_state_dict_from_zero_checkpoint(str(runs / source))
        rebuilt = get_fp32_state_dict_from_zero_checkpoint(str(runs / name))
    consolidated = load_file(runs / name / "model.safetensors")
    assert sorted(consolidated) == sorted(reference)
    stage = EXPORTS[name][2]
    for key, tensor in reference.items():
        assert_bits(consolidated[key], tensor, key)
        if stage >= 2 or not key.startswith("frozen."):  # stage-1 files hold no frozen fragments
            assert_bits(rebuilt[key], tensor, key)


def test_fp16_import_is_bit_identical(runs):
    """fp16 (DynamicLossScaler, no file prefix): the import equals zero_to_fp32 and the live engine."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with contextlib.redirect_stdout(io.StringIO()):
        reference = get_fp32_state_dict_from_zero_checkpoint(str(runs / "z2-fp16"))
    imported = read_source(str(runs / "z2-fp16")).state
    saved = state(runs, "z2-fp16")
    assert imported["module"]["first.weight"].dtype == torch.float16
    for key, tensor in reference.items():
        assert_bits(imported["fp32"][key], tensor, key)
    for param in saved["fp32"]:
        for key in ("exp_avg", "exp_avg_sq"):
            assert_bits(imported["optimizer"]["state"][param][key], saved[key][param], f"{param}/{key}")


def test_reimport_of_the_export_is_the_same_checkpoint(runs):
    first = read_source(str(runs / "z3-bf16")).state
    again = read_source(str(runs / "z3-bf16-to-3")).state
    assert again["deepspeed"]["dp_world_size"] == 3 and again["deepspeed"]["zero_stage"] == 3
    for param, tensor in first["fp32"].items():
        assert_bits(again["fp32"][param], tensor, param)
    for param, moments in first["optimizer"]["state"].items():
        for key, value in moments.items():
            if isinstance(value, (torch.Tensor, ckptfmt.Sharded)):
                assert_bits(again["optimizer"]["state"][param][key], value, f"{param}/{key}")


def test_zero_stage_pickle_is_deepspeeds_enum():
    import pickle

    from deepspeed.runtime.zero.config import ZeroStageEnum

    assert [pickle.loads(_ZERO_STAGE_PICKLE % s) for s in (1, 2, 3)] == \
        [ZeroStageEnum.optimizer_states, ZeroStageEnum.gradients, ZeroStageEnum.weights]


def test_failed_export_leaves_nothing(runs, tmp_path, monkeypatch):
    from ckptfmt.converters import deepspeed_export

    calls = []

    def failing_save(value, path):
        calls.append(path)
        if len(calls) == 3:
            raise OSError("disk full")
        torch.save(value, path)

    monkeypatch.setattr(deepspeed_export, "_save", failing_save)
    dest = tmp_path / "out"
    with pytest.raises(OSError, match="disk full"):
        export_checkpoint(runs / "repo" / "z2-bf16", dest, format="deepspeed", world_size=3)
    assert sorted(os.listdir(dest)) == []  # no tag folder, no temp folder, no latest


def test_existing_tag_and_bad_requests(runs, tmp_path):
    dest = tmp_path / "out"
    export_checkpoint(runs / "repo" / "z1-fp32", dest, format="deepspeed", world_size=2)
    before = sorted(p.name for p in (dest / "global_step3").iterdir())
    with pytest.raises(CheckpointError, match="already exists"):
        export_checkpoint(runs / "repo" / "z1-fp32", dest, format="deepspeed", world_size=4)
    assert sorted(p.name for p in (dest / "global_step3").iterdir()) == before
    with pytest.raises(CheckpointError, match="world size"):
        export_checkpoint(runs / "repo" / "z1-fp32", tmp_path / "w0", format="deepspeed", world_size=0)
    with pytest.raises(CheckpointError, match="deepspeed only"):
        export_checkpoint(runs / "repo" / "z1-fp32", tmp_path / "x.pt", format="torch", world_size=2)
    plain = ckptfmt.save({"model": {"w": torch.ones(3)}}, tmp_path / "repo" / "plain")
    with pytest.raises(CheckpointError, match="not imported from a DeepSpeed ZeRO checkpoint"):
        export_checkpoint(plain, tmp_path / "plain-out", format="deepspeed")


def test_cli_export_with_a_config_file(runs, tmp_path):
    config = state(runs, "z3-bf16-to-3")["client_state"]["ds_config"]
    config = dict(config, zero_optimization={"stage": 3, "sub_group_size": 20})  # several sub-groups per rank
    path = tmp_path / "ds_config.json"
    path.write_text(__import__("json").dumps(config))
    dest = tmp_path / "out"
    result = subprocess.run([sys.executable, "-m", "ckptfmt.cli", "export", str(runs / "repo" / "z3-bf16"), str(dest),
                             "--format", "deepspeed", "--world-size", "2", "--ds-config", str(path)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "ZeRO stage 3 for 2 data-parallel rank(s), bf16" in result.stdout
    optim = torch.load(dest / "global_step3" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt", weights_only=False)
    assert len(optim["optimizer_state_dict"]["fp32_flat_groups"]) > 2
    again = read_source(str(dest)).state  # and the sub-grouped layout reads back whole
    first = read_source(str(runs / "z3-bf16")).state
    for param, tensor in first["fp32"].items():
        assert_bits(again["fp32"][param], tensor, param)
    bad = subprocess.run([sys.executable, "-m", "ckptfmt.cli", "export", str(runs / "repo" / "z3-bf16"),
                          str(tmp_path / "o2"), "--format", "deepspeed", "--ds-config", str(tmp_path / "missing.json")],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "missing.json" in bad.stderr and "Traceback" not in bad.stderr
