"""Importing tensor-parallel DeepSpeed checkpoints (mp_rank_XX files) written by the real DeepSpeed.

One torchrun of 4 CPU ranks (tests/deepspeed_train_tp.py: mp=2 x dp=2, gloo) trains a tiny model
with a column-parallel linear (split on dim 0), a row-parallel linear (split on dim 1), a
replicated LayerNorm, an embedding tied to the output head, and two optimizer groups, for each
(stage, dtype); each model-parallel rank saves what its live engine held (DeepSpeed's
safe_get_full_* API). The tests concatenate those with the known dims and compare the import
bit for bit: with the dims given (tp_dims), inferred, or read from universal_checkpoint_info.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.support.helpers import assert_bits, deepspeed_torchrun, require_module, whole

pytestmark = [pytest.mark.exhaustive, pytest.mark.deepspeed, pytest.mark.distributed, pytest.mark.slow]
deepspeed = require_module("deepspeed", "DeepSpeed is not installed (a test-only dependency)")

import ckptfmt
from ckptfmt import CheckpointError
from ckptfmt.cli import main as cli
from ckptfmt.converters import import_checkpoint
from ckptfmt.converters.importer import read_source

CONFIGS = [(0, "fp32"), (1, "bf16"), (2, "fp32-uci"), (3, "fp32"), (3, "bf16")]
ZERO = [f"z{stage}-{dtype}" for stage, dtype in CONFIGS if stage > 0]
#: how the model splits each parameter over the 2 model-parallel ranks (None: replicated)
DIMS = {"embed.weight": None, "norm.weight": None, "norm.bias": None, "col.weight": 0, "col.bias": 0,
        "row.weight": 1}
TP_DIMS = {r"^col\.": 0, r"^row\.weight$": 1, r"^(embed|norm)\.": None}
GROUPS = [(["embed.weight", "col.weight", "row.weight"], 0.1), (["norm.weight", "norm.bias", "col.bias"], 0.0)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """Every configuration's checkpoint folder, from one torchrun of 4 CPU ranks."""
    out = tmp_path_factory.mktemp("deepspeed-tp")
    deepspeed_torchrun("deepspeed_train_tp.py", 4, str(out),
                       *(a for stage, dtype in CONFIGS for a in (str(stage), dtype)), timeout=600)
    return out


def expected(runs: Path, name: str, key: str, param: str) -> torch.Tensor:
    """What the engines held for ``param``, the two model-parallel ranks' values merged by DIMS."""
    ranks = [torch.load(runs / f"{name}.mp{mp}.expected.pt")[key][param] for mp in range(2)]
    if DIMS[param] is None:
        assert_bits(ranks[0], ranks[1])  # the model keeps replicated parameters identical
        return ranks[0]
    return torch.cat(ranks, DIMS[param])


def check_against_engines(runs: Path, name: str, state: dict) -> None:
    for param in DIMS:
        assert_bits(whole(state["fp32"][param]), expected(runs, name, "fp32", param))
        moments = state["optimizer"]["state"][param]
        for key in ("exp_avg", "exp_avg_sq"):
            assert_bits(whole(moments[key]), expected(runs, name, key, param))
        assert float(moments["step"]) == 3.0


@pytest.mark.parametrize("name", ZERO)
def test_user_dims_give_the_engines_values_as_shards(runs, name):
    imported = read_source(str(runs / name), options={"tp_dims": TP_DIMS})
    state = imported.state
    check_against_engines(runs, name, state)
    for param, dim in DIMS.items():  # split parameters stay in each model-parallel rank's shards
        shards = getattr(state["fp32"][param], "shards", [])
        if dim is None:  # model-parallel rank 0's tensor, whole or as its data-parallel shards
            assert all(shard.rank % 2 == 0 for shard in shards)
            continue
        for mp in range(2):  # a shard's rank: data-parallel rank * 2 + model-parallel rank
            want = torch.load(runs / f"{name}.mp{mp}.expected.pt")["fp32"][param]
            mine = [s for s in shards if s.rank % 2 == mp]
            start = min(s.offsets[dim] for s in mine)
            moved = [ckptfmt.Shard(tuple(o - start * (d == dim) for d, o in enumerate(s.offsets)), s.tensor, s.rank)
                     for s in mine]
            assert_bits(ckptfmt.Sharded(want.shape, moved), want)
    assert state["fp32"]["head.weight"] is state["fp32"]["embed.weight"]  # tied, as zero_to_fp32 aliases it
    meta = imported.metadata["deepspeed"]
    assert meta["mp_world_size"] == 2 and meta["dp_world_size"] == 2
    assert meta["parallel_dimensions"] == {"pp_degree": 1, "tp_degree": 2}
    assert {k: meta["tp_merge"][k] for k in DIMS} == {k: "replicated" if d is None else d for k, d in DIMS.items()}
    assert not any("inferred" in note and "col." in note for note in imported.notes)


@pytest.mark.parametrize("name", ZERO)
def test_param_groups_and_client_state(runs, name):
    state = read_source(str(runs / name)).state
    groups = state["optimizer"]["param_groups"]
    assert [(g["params"], g["weight_decay"]) for g in groups] == GROUPS
    assert state["client_state"] == {"epoch": 1} and "client_state_by_mp_rank" not in state
    assert state["global_step"] == 3 and state["deepspeed"]["shared_params"] == {"head.weight": "embed.weight"}


@pytest.mark.parametrize("name", ["z1-bf16", "z3-fp32"])
def test_inferred_dims(runs, name):
    """Without rules: identical on both ranks -> replicated, else dim 0 (row.weight too), all noted."""
    imported = read_source(str(runs / name))
    state, merge = imported.state, imported.metadata["deepspeed"]["tp_merge"]
    assert merge["row.weight"] == 0 and merge["col.weight"] == 0 and merge["norm.weight"] == "replicated"
    assert whole(state["fp32"]["row.weight"]).shape == (12, 5)
    for param in ("embed.weight", "norm.weight", "norm.bias", "col.weight", "col.bias"):
        assert_bits(whole(state["fp32"][param]), expected(runs, name, "fp32", param))
    notes = "\n".join(imported.notes)
    assert "inferred replicated: scale, embed.weight, norm.weight, norm.bias" in notes
    assert "inferred concatenated on dim 0:" in notes and "row.weight" in notes


def test_universal_checkpoint_info(runs):
    """Megatron-DeepSpeed's patterns: replicated and row-parallel (dim 1) names; the rest inferred."""
    imported = read_source(str(runs / "z2-fp32-uci"))
    check_against_engines(runs, "z2-fp32-uci", imported.state)
    merge = imported.metadata["deepspeed"]["tp_merge"]
    assert merge["row.weight"] == 1 and merge["norm.bias"] == "replicated" and merge["col.bias"] == 0
    inferred = [n for n in imported.notes if "inferred" in n]
    assert inferred == ["2 model-parallel ranks: no tp_dims or universal_checkpoint_info rule, inferred "
                        "replicated: scale",
                        "2 model-parallel ranks: no tp_dims or universal_checkpoint_info rule, inferred "
                        "concatenated on dim 0: col.weight, col.bias"]
    assert imported.state["deepspeed"]["universal_checkpoint_info"]["parameter_with_row_parallelism_patterns"] \
        == [r"row\.weight$"]
    assert "universal_checkpoint_info" not in imported.state["client_state"]


def rewrite_model_states(folder: Path, mp: int, **changes) -> None:
    """Change top-level keys of a model states file (the test may run pickles; the importer never does)."""
    path = folder / "global_step3" / f"mp_rank_0{mp}_model_states.pt"
    states = torch.load(path, weights_only=False)
    states.update(changes)
    torch.save(states, path)


def test_universal_info_average_unsupported_layout_and_per_rank_client_state(runs, tmp_path):
    folder = tmp_path / "run"
    shutil.copytree(runs / "z2-fp32-uci", folder)
    info = torch.load(folder / "global_step3" / "mp_rank_00_model_states.pt", weights_only=False)[
        "universal_checkpoint_info"]
    rewrite_model_states(folder, 0, universal_checkpoint_info={**info, "parameter_to_average_patterns": [r"col\.bias"]})
    rewrite_model_states(folder, 1, epoch=2)
    imported = read_source(str(folder))
    state = imported.state
    ranks = [torch.load(runs / f"z2-fp32-uci.mp{mp}.expected.pt")["fp32"]["col.bias"] for mp in range(2)]
    assert_bits(state["fp32"]["col.bias"], (ranks[0] + ranks[1]) / 2)
    assert imported.metadata["deepspeed"]["tp_merge"]["col.bias"] == "average"
    assert any(n.startswith("averaged over the model-parallel ranks") and "col.bias" in n for n in imported.notes)
    assert state["client_state"] == {"epoch": 1} and state["client_state_by_mp_rank"] == [{"epoch": 1}, {"epoch": 2}]

    sub_params = [{"patterns": [r"col\.weight$"], "shape": (2, -1, 6), "partition_dim": 0}]
    rewrite_model_states(folder, 0, universal_checkpoint_info={**info, "parameter_with_sub_params": sub_params})
    with pytest.raises(CheckpointError, match=r"'col\.weight' has a parameter_with_sub_params layout"):
        read_source(str(folder))
    state = read_source(str(folder), options={"tp_dims": {r"col\.weight": 0}}).state  # the user's rule decides
    assert_bits(whole(state["fp32"]["col.weight"]), expected(runs, "z2-fp32-uci", "fp32", "col.weight"))


def test_module_merged_per_name(runs):
    """Stage 1/2 module weights (bf16) merge like the master weights; the tied head stays equal."""
    imported = read_source(str(runs / "z1-bf16"), options={"tp_dims": TP_DIMS})
    module = imported.state["module"]
    tag = runs / "z1-bf16" / "global_step3"
    raw = [torch.load(tag / f"mp_rank_0{mp}_model_states.pt", weights_only=False)["module"] for mp in range(2)]
    for param, dim in DIMS.items():
        want = raw[0][param] if dim is None else torch.cat([r[param] for r in raw], dim)
        assert_bits(whole(module[param]), want)
    assert module["col.weight"].shards[0].tensor.dtype == torch.bfloat16
    assert_bits(module["head.weight"], module["embed.weight"])
    assert_bits(module["scale"], raw[1]["scale"])


def test_stage0_module_merged_optimizer_per_rank(runs):
    imported = read_source(str(runs / "z0-fp32"), options={"tp_dims": TP_DIMS})
    state = imported.state
    for param in DIMS:
        assert_bits(whole(state["module"][param]), expected(runs, "z0-fp32", "fp32", param))
    assert isinstance(state["optimizer"], list) and len(state["optimizer"]) == 2
    for mp, osd in enumerate(state["optimizer"]):
        want = torch.load(runs / f"z0-fp32.mp{mp}.expected.pt")
        for index, param in enumerate(p for g, _ in GROUPS for p in g):  # torch numbers them group by group
            assert_bits(osd["state"][index]["exp_avg"], want["exp_avg"][param])
    assert any("one state dict per model-parallel rank" in n for n in imported.notes)


def test_import_and_load_back_through_the_cli(runs, tmp_path, capsys):
    dest = tmp_path / "repo" / "tp"
    args = ["import", str(runs / "z3-bf16"), str(dest), "--tp-dim", r"^col\.=0", "--tp-dim", r"^row\.weight$=1",
            "--tp-dim", r"^(embed|norm)\.=replicated"]
    assert cli(args) == 0, capsys.readouterr().err
    loaded = ckptfmt.load(str(dest))
    check_against_engines(runs, "z3-bf16", loaded)
    assert loaded["fp32"]["head.weight"] is loaded["fp32"]["embed.weight"]
    with ckptfmt.open(str(dest)) as reader:
        meta = reader.metadata["user"]["deepspeed"]
        assert meta["tp_merge"]["row.weight"] == 1 and meta["mp_world_size"] == 2
    assert cli(["import", str(runs / "z3-bf16"), str(tmp_path / "repo" / "bad"), "--tp-dim", "row=x"]) == 2
    assert "--tp-dim" in capsys.readouterr().err


def test_replicated_rule_that_does_not_hold_names_the_parameter(runs):
    with pytest.raises(CheckpointError, match=r"'col\.weight' is replicated \(tp_dims"):
        read_source(str(runs / "z2-fp32-uci"), options={"tp_dims": {r"col\.weight": None}})


@pytest.mark.parametrize("missing", ["zero_pp_rank_1_mp_rank_01_optim_states.pt", "mp_rank_01_model_states.pt"])
def test_missing_rank_file_names_it_and_commits_nothing(runs, missing, tmp_path):
    folder = tmp_path / "run"
    shutil.copytree(runs / "z2-fp32-uci", folder)
    (folder / "global_step3" / missing).unlink()
    repo = tmp_path / "repo"
    with pytest.raises(CheckpointError, match=missing):
        import_checkpoint(folder, repo / "imported")
    assert not repo.exists() or ckptfmt.Repository.open(str(repo)).names() == []


@pytest.mark.parametrize("extra, message", [("layer_01-model_00-model_states.pt", "pipeline-parallel"),
                                            ("expert_0_mp_rank_00_model_states.pt", "mixture-of-experts")])
def test_pipeline_and_moe_folders_are_refused(runs, tmp_path, extra, message):
    folder = tmp_path / "run"
    shutil.copytree(runs / "z1-bf16", folder)
    (folder / "global_step3" / extra).write_bytes(b"")
    with pytest.raises(CheckpointError, match=message):
        read_source(str(folder), kind="deepspeed")
