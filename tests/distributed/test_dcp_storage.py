"""ckptfmt.dcp: torch.distributed.checkpoint saving and loading ckptfmt checkpoints, both ways.

Multi-rank runs use 4 (save) and 2 (load) real gloo ranks with DTensors; the
single-process cases cover a model with its AdamW state.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import ckptfmt
from ckptfmt.dcp import StorageReader, StorageWriter
from ckptfmt.metadata.step_timer import decode_steps
from tests.support.helpers import assert_same
from tests.support.ranks import mixed_state, run_ranks
from tests.support.tensor_values import assert_stats_close, expected_stats

#: DCP warns that it saves "in a single process" when no process group is initialised.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.ReLU(), torch.nn.Linear(300, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(8, 64)).sum().backward()
    optimizer.step()
    return model, optimizer


def tensors_by_key(tree, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a state under its ckptfmt key ('model/0.weight', 'optim/state/0/exp_avg')."""
    if isinstance(tree, torch.Tensor):
        return {prefix: tree}
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, (list, tuple)) else ()
    return {key: tensor for name, value in items
            for key, tensor in tensors_by_key(value, f"{prefix}/{name}" if prefix else str(name)).items()}


def unlike_any_saved(state: dict) -> dict:
    """``state`` with every tensor filled with -1 and every hyperparameter changed: a value DCP leaves
    unloaded shows (a fresh AdamW's ``step`` and settings would equal the saved ones)."""
    for tensor in tensors_by_key(state).values():
        tensor.fill_(-1)
    for group in state["optim"]["param_groups"]:
        group.update(lr=0.5, betas=(0.5, 0.5), eps=0.5, weight_decay=0.5)
    return state


def test_a_dcp_save_is_a_normal_ckptfmt_checkpoint_and_loads_back_through_dcp(tmp_path):
    model, optimizer = trained(0)
    url = str(tmp_path / "repo" / "step-5")
    saved = {"model": model.state_dict(), "optim": optimizer.state_dict(), "step": 5}
    dcp.save(saved, storage_writer=StorageWriter(url, step=5))
    assert ckptfmt.verify(url).ok
    with ckptfmt.open(url) as reader:
        assert reader.keys()[0] == "model/0.weight"  # nesting and state order kept
        assert reader.metadata["step"] == 5 and reader.metadata["provenance"]["source_kind"] == "dcp"
        assert b"pickle" not in reader.manifest.state and reader.manifest.chunks
        expected = tensors_by_key(saved)  # DCP hands over flattened keys: the state's containers are not kept
        assert reader.keys() == list(expected)
        for key, tensor in expected.items():
            assert_same(tensor, reader.get_tensor(key), key)
            assert_stats_close(expected_stats(tensor), reader.tensor_stats(key), key)
    loaded = ckptfmt.load(url)
    assert_same((saved["step"], saved["optim"]["param_groups"]), (loaded["step"], loaded["optim"]["param_groups"]))

    fresh, fresh_optimizer = trained(1)
    state = unlike_any_saved({"model": fresh.state_dict(), "optim": fresh_optimizer.state_dict(), "step": 0})
    dcp.load(state, storage_reader=StorageReader(url))
    assert_same(saved, state)
    fresh.load_state_dict(state["model"])
    fresh_optimizer.load_state_dict(state["optim"])
    assert_same(saved, {"model": fresh.state_dict(), "optim": fresh_optimizer.state_dict(), "step": state["step"]})


def test_a_ckptfmt_save_loads_through_dcp(tmp_path):
    """Every tensor and plain value DCP loads is the saved one, bit for bit (hyperparameters included)."""
    model, optimizer = trained(0)
    saved = {"model": model.state_dict(), "optim": optimizer.state_dict(), "step": 3}
    url = ckptfmt.save(saved, tmp_path / "repo" / "a")
    fresh, fresh_optimizer = trained(1)
    state = unlike_any_saved({"model": fresh.state_dict(), "optim": fresh_optimizer.state_dict(), "step": 0})
    dcp.load(state, storage_reader=StorageReader(url))
    assert_same(saved, state)


def test_a_dcp_save_to_a_taken_name_fails_and_keeps_the_checkpoint(tmp_path):
    url = str(tmp_path / "repo" / "a")
    dcp.save({"w": torch.ones(3)}, storage_writer=StorageWriter(url))
    with pytest.raises(CheckpointException) as info:  # DCP gathers every rank's error into one
        dcp.save({"w": torch.zeros(3)}, storage_writer=StorageWriter(url))
    assert [type(error) for error, _ in info.value.failures.values()] == [ckptfmt.CheckpointExistsError]
    assert torch.equal(ckptfmt.load(url)["w"], torch.ones(3))


def test_the_dcp_writer_takes_a_saves_options_deltas_statistics_and_steps(tmp_path):
    """A run saved through DCP: each checkpoint names its parent, stores deltas against it with delta-zstd
    (fewer new bytes than shuffle-zstd, loaded bit for bit), records its rank's training steps, and takes
    its tensor statistics unless told not to."""
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(512, 1024, generator=generator), torch.randn(256, 1024, generator=generator)]
    new_bytes = {}
    for compression in ("delta-zstd", "shuffle-zstd"):
        repo = tmp_path / compression
        timer = ckptfmt.StepTimer()
        for step in range(2):
            with timer.step(step):
                timer.batch([step])
            state = {"model": {"a": weights[0] + 1e-3 * step, "b": weights[1] * (1 + 1e-4 * step)}, "step": step}
            dcp.save(state, storage_writer=StorageWriter(repo / f"step-{step}", compression=compression,
                                                         chunk_size=2**18, timer=timer, tensor_stats=step == 0))
        new_bytes[compression] = ckptfmt.Repository.open(str(repo)).commit("step-1").totals["new_bytes"]
        with ckptfmt.open(str(repo / "step-1")) as reader:
            assert reader.manifest.parent == "step-0"
            assert reader.tensor_stats("model/a") is None  # tensor_stats=False
            deltas = [chunk for chunk in reader.manifest.chunks if chunk.base is not None]
            (rank,) = reader.metadata["timing"]["ranks"]
            assert decode_steps(rank["steps"], "rank 0").step.tolist() == [1]  # the step since step-0
            assert_same(reader.get_tensor("model/a"), state["model"]["a"], "model/a")
        with ckptfmt.open(str(repo / "step-0")) as reader:
            assert_stats_close(expected_stats(weights[0]), reader.tensor_stats("model/a"), "model/a")
        assert bool(deltas) == (compression == "delta-zstd")
        assert ckptfmt.verify(str(repo)).ok
        loaded = {"model": {"a": torch.zeros(512, 1024), "b": torch.zeros(256, 1024)}, "step": -1}
        dcp.load(loaded, storage_reader=StorageReader(repo / "step-1"))
        assert_same(state, loaded)
    assert new_bytes["delta-zstd"] < 0.8 * new_bytes["shuffle-zstd"]


def test_checkpoint_ids_are_checked():
    assert StorageWriter.validate_checkpoint_id("runs/a/step-1")
    assert not StorageWriter.validate_checkpoint_id("runs/a/chunks")  # a reserved name


# -- 4 ranks save through DCP, 2 ranks load through DCP ---------------------------------------------
def dcp_save_on_ranks(rank: int, world: int, folder: Path, url: str, asynchronous: bool) -> dict:
    state, full = mixed_state(rank, world)
    del state["loader"], state["seen_by"]  # plain per-rank values are ckptfmt.save's business
    torch.manual_seed(100 + rank)  # each rank's own RNG state, recorded per rank
    if asynchronous:
        dcp.async_save(state, storage_writer=StorageWriter(url)).result(timeout=120)
    else:
        dcp.save(state, storage_writer=StorageWriter(url))
    return full


def dcp_load_on_ranks(rank: int, world: int, folder: Path, url: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    state = {"model": {
        "layers": [torch.zeros(64, 1024) for _ in range(8)], "bias": torch.zeros(10),
        "row": distribute_tensor(torch.zeros(10, 3), mesh, [Shard(0)]),
        "grid": distribute_tensor(torch.zeros(6, 8), mesh, [Shard(1)]),
        "half": distribute_tensor(torch.zeros(7, 5), mesh, [Shard(0)]),
    }, "step": 0}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, storage_reader=StorageReader(url))
    model = state["model"]
    return {"step": state["step"], "layers": model["layers"], "bias": model["bias"],
            **{key: model[key].full_tensor() for key in ("row", "grid", "half")}}


def loaded_through_dcp(full: dict) -> dict:
    """What ``dcp_load_on_ranks`` returns when every value loaded is the saved one."""
    return {"step": 7, **{key: full[key] for key in ("layers", "bias", "row", "grid", "half")}}


@pytest.mark.parametrize("asynchronous", [
    pytest.param(False, id="save"),
    # make test's budget: the asynchronous writer's path is also covered on 2 ranks in test_collective_save
    pytest.param(True, id="async_save", marks=pytest.mark.exhaustive),
])
def test_dcp_on_4_ranks_then_dcp_load_on_2(tmp_path, asynchronous):
    url = str(tmp_path / "repo" / "step-7")
    saved = run_ranks(dcp_save_on_ranks, 4, tmp_path / "save", url=url, asynchronous=asynchronous)
    full = saved[0].unwrap()
    assert ckptfmt.verify(url).ok
    with ckptfmt.open(url) as reader:
        assert len(reader.tensor_info("model/row").shards) == 4  # each rank's shard, as DCP planned it
        meta = reader.metadata
    # Every rank's own record, though DCP hands finish() only the write results.
    assert [e["rank"] for e in meta["rng"]] == [0, 1, 2, 3]
    assert len({bytes(e["torch_cpu"]) for e in meta["rng"]}) == 4  # each rank seeded its own generator
    topology = meta["topology"]
    assert [r["rank"] for r in topology["ranks"]] == [0, 1, 2, 3]
    assert len({r["pid"] for r in topology["ranks"]}) == 4
    # The topology a collective save records: the backend, and the meshes of the DTensors saved.
    assert topology["world_size"] == 4 and topology["backend"] == "gloo"
    assert topology["meshes"] == [{"shape": [4], "dim_names": ["dp"]}, {"shape": [2, 2], "dim_names": ["dp", "tp"]}]
    assert meta["environment"]["ranks"] == [0, 1, 2, 3]
    timing = meta["timing"]["ranks"]
    assert [t["rank"] for t in timing] == [0, 1, 2, 3]
    assert all("write_chunks" in [p["name"] for p in t["phases"]] for t in timing)
    with ckptfmt.open(url) as reader:  # DCP hands over flattened keys: the list of layers is not kept
        expected = {f"model/{key}": tensor for key, tensor in tensors_by_key(full).items()}
        assert sorted(reader.keys()) == sorted(expected)
        for key, tensor in expected.items():
            assert_same(tensor, reader.get_tensor(key), key)
            assert_stats_close(expected_stats(tensor), reader.tensor_stats(key), key)  # shards' merged
    assert ckptfmt.load(url)["step"] == 7
    for outcome in run_ranks(dcp_load_on_ranks, 2, tmp_path / "load", url=url):
        assert_same(loaded_through_dcp(full), outcome.unwrap())


def test_a_collective_ckptfmt_save_loads_through_dcp_on_2_ranks(tmp_path):
    from tests.support.ranks import save_mixed_state

    run_ranks(save_mixed_state, 4, tmp_path / "save", repo=str(tmp_path / "repo"))[0].unwrap()
    url = str(tmp_path / "repo" / "step-7")
    full = ckptfmt.load(url)["model"]
    for outcome in run_ranks(dcp_load_on_ranks, 2, tmp_path / "load", url=url):
        assert_same(loaded_through_dcp(full), outcome.unwrap())
