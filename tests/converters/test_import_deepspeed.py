"""Importing DeepSpeed ZeRO checkpoints written by the real DeepSpeed (2 ranks on CPU, gloo), pickles never run.

One torchrun run (tests/deepspeed_train.py) trains a tiny model 3 steps for every
(stage, dtype) and saves each checkpoint plus what the live engine held (gathered with
DeepSpeed's own safe_get_full_* API); the tests compare the import against those and
against deepspeed.utils.zero_to_fp32, bit for bit.
"""

from __future__ import annotations

import contextlib
import io
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.helpers import assert_bits, deepspeed_torchrun, require_module, whole

pytestmark = [pytest.mark.deepspeed, pytest.mark.distributed, pytest.mark.slow]
deepspeed = require_module("deepspeed", "DeepSpeed is not installed (a test-only dependency: "
                           "DS_BUILD_OPS=0 pip install -c constraints-dev.txt deepspeed)")

import ckptfmt
from ckptfmt import CheckpointError
from ckptfmt.converters import import_checkpoint
from ckptfmt.converters.importer import detect_kind, read_source

CONFIGS = [(0, "fp32"), (1, "fp32"), (2, "fp32"), (3, "fp32"), (1, "bf16"), (2, "bf16"), (3, "bf16"),
           (2, "fp32-elastic"), (1, "bf16-fp32acc")]
#: and with 3 ranks (odd: stage-3 pieces of ceil(numel / 3), stage-1/2 alignment to 6), in OUT/ws3/
CONFIGS_3 = [(2, "fp32"), (3, "bf16")]
#: The 3-rank launch's checks run in make test-exhaustive (about 40 s of launch); make test keeps 2 ranks.
WS3 = pytest.mark.exhaustive
ZERO = [f"z{stage}-{dtype}" for stage, dtype in CONFIGS if stage > 0] + \
    [pytest.param(f"ws3/z{stage}-{dtype}", marks=WS3) for stage, dtype in CONFIGS_3]
#: bf16 + ZeRO-1 + fp32 gradient accumulation runs DeepSpeed's BF16_Optimizer, whose files record no ZeRO
#: stage: zero_to_fp32 refuses them ("is not a zero checkpoint"); the engine's own values are compared.
ZERO_TO_FP32 = [name for name in ZERO if name != "z1-bf16-fp32acc"]
TRAINABLE = ["first.weight", "first.bias", "second.weight", "second.bias"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, request) -> Path:
    """Every configuration's checkpoint folder: one torchrun of 2 CPU ranks, and one of 3 when a selected
    test reads its folder (``ws3/``)."""
    out = tmp_path_factory.mktemp("deepspeed")
    (out / "ws3").mkdir()
    launches = [(2, out, CONFIGS)]
    if any("ws3/" in item.name for item in request.session.items if item.module is request.module):
        launches.append((3, out / "ws3", CONFIGS_3))
    for ranks, folder, configs in launches:
        deepspeed_torchrun("deepspeed_train.py", ranks, str(folder),
                           *(a for stage, dtype in configs for a in (str(stage), dtype)))
    return out


def expected(runs: Path, name: str) -> dict:
    return torch.load(runs / f"{name}.expected.pt", weights_only=False)


def model_file(folder: Path) -> Path:
    tag = (folder / "latest").read_text().strip()
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"):
        if (folder / tag / name).exists():
            return folder / tag / name
    raise AssertionError(f"no model states file in {folder / tag}")


@pytest.mark.parametrize("name", ZERO_TO_FP32)
def test_fp32_bit_identical_to_zero_to_fp32(runs, name):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    folder = runs / name
    with contextlib.redirect_stdout(io.StringIO()):
        reference = get_fp32_state_dict_from_zero_checkpoint(str(folder))
    imported = read_source(str(folder))
    fp32 = imported.state["fp32"]
    assert list(fp32) == list(reference)  # buffers, frozen, trainable: zero_to_fp32's order
    assert {"scale", "first.weight"} <= set(fp32)
    # DeepSpeed saves frozen parameters' fragments from stage 2 on (stage 1: only in "module")
    assert ("frozen.weight" in fp32) == (int(name.rsplit("/", 1)[-1][1]) >= 2)
    for key, tensor in reference.items():
        assert_bits(fp32[key], tensor)


@pytest.mark.parametrize("name", ZERO)
def test_master_weights_and_moments_equal_the_engines(runs, name):
    """Per parameter: what DeepSpeed's safe_get_full_fp32_param / _optimizer_state gave the live engine."""
    want = expected(runs, name)
    state = read_source(str(runs / name)).state
    assert sorted(want["fp32"]) == sorted(TRAINABLE)
    for param in TRAINABLE:
        assert_bits(state["fp32"][param], want["fp32"][param])
        moments = state["optimizer"]["state"][param]
        for key in ("exp_avg", "exp_avg_sq"):
            assert_bits(moments[key], want[key][param])
            assert torch.isfinite(whole(moments[key])).all()
        assert float(moments["step"]) == 3.0
    assert "frozen.weight" not in state["optimizer"]["state"]
    if name.endswith("-elastic"):  # an elastic checkpoint keeps no param_groups
        assert state["optimizer"]["param_groups"] == []
        return
    group = state["optimizer"]["param_groups"][0]
    assert group["params"] == TRAINABLE and group["betas"] == (0.9, 0.999)


@pytest.mark.parametrize("name", ZERO)
def test_module_step_and_client_state(runs, name):
    folder = runs / name
    world = 3 if name.startswith("ws3/") else 2
    config = name.rsplit("/", 1)[-1]
    stage, dtype = int(config[1]), config.split("-")[1]  # fp32-elastic: fp32; bf16-fp32acc: bf16
    imported = read_source(str(folder))
    raw = torch.load(model_file(folder), weights_only=False)  # the test may run pickles; the importer never does
    assert list(imported.state["module"]) == list(raw["module"])
    for key, tensor in raw["module"].items():
        assert_bits(imported.state["module"][key], tensor)
    if stage < 3:
        wanted = torch.bfloat16 if dtype == "bf16" else torch.float32
        assert imported.state["module"]["first.weight"].dtype == wanted
        assert imported.state["module"]["first.weight"].shape == (7, 5)
    assert imported.kind == "deepspeed" and imported.step == 3 == raw["global_steps"]
    assert imported.state["global_step"] == 3
    assert imported.state["client_state"] == {"epoch": 1, "note": "tiny"}
    assert imported.state["lr_scheduler"] == raw["lr_scheduler"]
    assert imported.versions == {"deepspeed": deepspeed.__version__}
    meta = imported.metadata["deepspeed"]
    assert meta["zero_stage"] == stage and meta["dp_world_size"] == world and meta["bf16"] == (dtype == "bf16")
    assert meta["config"]["zero_optimization"]["stage"] == stage
    assert imported.state["deepspeed"]["zero_stage"] == stage


def is_view(tensor: torch.Tensor) -> bool:
    """The tensor views a larger storage (a rank's mapped partition), not memory of its own."""
    return tensor.untyped_storage().nbytes() > tensor.nbytes


def test_partitions_stay_mapped_stage2(runs):
    """ZeRO-2, 2 ranks: first.weight (7x5) is cut inside row 6 (rank 0 holds 34 of its 35 elements): rows 0-5
    view rank 0's partition, row 6 is copied; parameters inside one partition are views of it."""
    state = read_source(str(runs / "z2-fp32")).state
    for value in (state["fp32"]["first.weight"], state["optimizer"]["state"]["first.weight"]["exp_avg"]):
        assert isinstance(value, ckptfmt.Sharded) and value.shape == (7, 5)
        assert [(s.offsets, tuple(s.tensor.shape), s.rank) for s in value.shards] == \
            [((0, 0), (6, 5), 0), ((6, 0), (1, 5), 0)]
        assert is_view(value.shards[0].tensor) and not is_view(value.shards[1].tensor)
    for param in ("second.weight", "second.bias"):
        assert isinstance(state["fp32"][param], torch.Tensor) and is_view(state["fp32"][param])
        assert is_view(state["optimizer"]["state"][param]["exp_avg_sq"])


@pytest.mark.parametrize("name, rows", [("z3-fp32", [(0, 3, 0), (3, 1, 0), (4, 3, 1)]),
                                        pytest.param("ws3/z3-bf16", [(0, 2, 0), (2, 1, 0), (3, 1, 1), (4, 1, 1),
                                                                     (5, 2, 2)], marks=WS3)])
def test_partitions_stay_mapped_stage3(runs, name, rows):
    """ZeRO-3 cuts first.weight (7x5) in ceil(35 / ranks) pieces: whole rows stay views of each rank's
    partition, each row a cut goes through is copied (owned by its first element's rank); 1-d tensors are copied."""
    state = read_source(str(runs / name)).state
    for value in (state["fp32"]["first.weight"], state["optimizer"]["state"]["first.weight"]["exp_avg"],
                  state["fp32"]["frozen.weight"]):
        assert [(s.offsets[0], s.tensor.shape[0], s.rank) for s in value.shards] == rows
        assert [is_view(s.tensor) for s in value.shards] == [i % 2 == 0 for i in range(len(rows))]
    assert isinstance(state["fp32"]["first.bias"], torch.Tensor)


def test_stage0_module_and_optimizer(runs):
    folder = runs / "z0-fp32"
    want = expected(runs, "z0-fp32")
    imported = read_source(str(folder))
    state = imported.state
    assert imported.step == 3 and state["deepspeed"]["zero_stage"] == 0 and "fp32" not in state
    for index, param in enumerate(TRAINABLE):  # the torch optimizer's own state dict, by index
        assert_bits(state["module"][param], want["fp32"][param])
        for key in ("exp_avg", "exp_avg_sq"):
            assert_bits(state["optimizer"]["state"][index][key], want[key][param])


@pytest.mark.parametrize("name", ["z2-bf16", "z3-fp32"])
def test_import_and_load_back(runs, name, tmp_path):
    folder = runs / name
    assert detect_kind(str(folder)) == "deepspeed"
    assert detect_kind(str(folder / "global_step3")) == "deepspeed"  # the tag folder itself
    result = import_checkpoint(folder, tmp_path / "repo" / "imported")
    assert result.kind == "deepspeed" and result.tensors > 0
    assert "zero_optimizer/loss_scaler" in result.opaque  # DeepSpeed's LossScaler object: never unpickled
    loaded = ckptfmt.load(result.url)
    imported = read_source(str(folder))
    for key, tensor in imported.state["fp32"].items():
        assert_bits(loaded["fp32"][key], tensor)
    for param in TRAINABLE:
        for key in ("exp_avg", "exp_avg_sq"):
            assert_bits(loaded["optimizer"]["state"][param][key], imported.state["optimizer"]["state"][param][key])
    assert loaded["global_step"] == 3 and loaded["client_state"] == {"epoch": 1, "note": "tiny"}
    assert isinstance(loaded["zero_optimizer"]["loss_scaler"], ckptfmt.OpaqueObject)
    with ckptfmt.open(result.url) as reader:
        assert reader.manifest.step == 3
        assert reader.metadata["provenance"]["versions"]["deepspeed"] == deepspeed.__version__


def test_works_without_deepspeed_installed(runs):
    """The importer never imports DeepSpeed: block it and read a stage-3 bf16 folder."""
    code = ("import sys; sys.modules['deepspeed'] = None\n"
            "from ckptfmt.converters.importer import read_source\n"
            f"s = read_source({str(runs / 'z3-bf16')!r}).state\n"
            "assert s['fp32']['first.weight'].shape == (7, 5)\n"
            "assert 'deepspeed' not in [m for m in sys.modules if sys.modules[m] is not None]\n")
    result = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-4000:]


@pytest.mark.parametrize("name, missing", [
    ("z2-fp32", "zero_pp_rank_1_mp_rank_00_optim_states.pt"),
    ("z3-bf16", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"),
    ("z3-fp32", "zero_pp_rank_1_mp_rank_00_model_states.pt"),
])
def test_missing_rank_file_names_it_and_commits_nothing(runs, name, missing, tmp_path):
    folder = tmp_path / name
    shutil.copytree(runs / name, folder)
    (folder / "global_step3" / missing).unlink()
    repo = tmp_path / "repo"
    with pytest.raises(CheckpointError, match=missing):
        import_checkpoint(folder, repo / "imported")
    assert not repo.exists() or ckptfmt.Repository.open(str(repo)).names() == []


def test_latest_naming_a_missing_tag(runs, tmp_path):
    folder = tmp_path / "run"
    shutil.copytree(runs / "z1-fp32", folder)
    (folder / "latest").write_text("global_step99")
    with pytest.raises(CheckpointError, match="global_step99"):
        read_source(str(folder), kind="deepspeed")
    assert detect_kind(str(runs / "z1-fp32" / "global_step3" / "mp_rank_00_model_states.pt")) == "torch"
