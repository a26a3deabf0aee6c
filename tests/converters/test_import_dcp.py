"""Importing torch.distributed.checkpoint (DCP) folders written by the real DCP, pickles never run."""

from __future__ import annotations

import itertools
import os
import socket
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint import FileSystemWriter

import ckptfmt
from ckptfmt import CheckpointError
from ckptfmt.converters import import_checkpoint
from ckptfmt.converters.dcp_format import BytesMeta, TensorMeta, read_metadata
from ckptfmt.converters.importer import detect_kind, read_source
from tests.support import markers


def nested_state() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    return {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "optim": {"state": {"w": {"step": 3, "lr": 0.25, "exp_avg": torch.randn(3, 4, dtype=torch.bfloat16)}},
                  "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "params": [0, 1]}]},
        "extra": {"ints": torch.arange(5, dtype=torch.int64), "name": "run-1", "scalar": torch.tensor(2.5),
                  "empty": torch.empty(0, 2)},
        "step": 7,
    }


def dcp_save(state: dict, folder: Path) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(state, storage_writer=FileSystemWriter(str(folder)))
    return folder


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> tuple[dict, Path]:
    state = nested_state()
    return state, dcp_save(nested_state(), tmp_path_factory.mktemp("dcp") / "single")


def assert_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def test_read_metadata_as_plain_data(single):
    _, folder = single
    md = read_metadata(str(folder))
    assert isinstance(md.entries["model.0.weight"], TensorMeta)
    assert md.entries["optim.state.w.exp_avg"].dtype == torch.bfloat16
    assert md.entries["optim.state.w.exp_avg"].chunks[0].sizes == (3, 4)
    assert isinstance(md.entries["optim.state.w.lr"], BytesMeta)
    assert md.planner_data["optim.param_groups.0.lr"] == ("optim", "param_groups", 0, "lr")
    for (fqn, offsets), info in md.storage.items():
        assert info.relative_path.endswith(".distcp") and info.length > 0
        assert (offsets is None) == isinstance(md.entries[fqn], BytesMeta)


def test_each_chunk_read_exactly(single):
    """Every item's (offset, length) lies in its file, items do not overlap, and cover the file."""
    _, folder = single
    md = read_metadata(str(folder))
    spans: dict[str, list] = {}
    for info in md.storage.values():
        spans.setdefault(info.relative_path, []).append((info.offset, info.offset + info.length))
    for name, ranges in spans.items():
        ranges.sort()
        assert ranges[0][0] == 0
        assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
        assert ranges[-1][1] == os.path.getsize(folder / name)


def test_single_process_nested_state(single, tmp_path):
    state, folder = single
    assert detect_kind(str(folder)) == "dcp" and detect_kind(str(folder / ".metadata")) == "dcp"
    result = import_checkpoint(folder, tmp_path / "repo" / "imported")
    assert result.kind == "dcp" and result.opaque == []
    loaded = ckptfmt.load(result.url)
    assert set(loaded) == {"model", "optim", "extra", "step"}
    for key, tensor in state["model"].items():
        assert_bits(loaded["model"][key], tensor)
    assert_bits(loaded["optim"]["state"]["w"]["exp_avg"], state["optim"]["state"]["w"]["exp_avg"])
    for key in ("ints", "scalar", "empty"):
        assert_bits(loaded["extra"][key], state["extra"][key])
    assert loaded["optim"]["state"]["w"]["step"] == 3 and type(loaded["optim"]["state"]["w"]["step"]) is int
    assert loaded["optim"]["state"]["w"]["lr"] == 0.25
    group = loaded["optim"]["param_groups"][0]
    assert group == {"lr": 0.1, "betas": (0.9, 0.999), "params": [0, 1]}
    assert loaded["extra"]["name"] == "run-1" and loaded["step"] == 7
    with ckptfmt.open(result.url) as ckpt:
        assert ckpt.manifest.provenance["source_kind"] == "dcp"


# --------------------------------------------------------------------------- two gloo ranks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, folder: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        full = torch.arange(6 * 3, dtype=torch.float32).reshape(6, 3) / 7
        state = {"model": {"w": distribute_tensor(full, mesh, [Shard(0)])}, "step": 5}
        dcp.save(state, storage_writer=FileSystemWriter(folder))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> Path:
    markers.require("distributed")
    folder = tmp_path_factory.mktemp("dcp2") / "ckpt"
    mp.spawn(_rank_main, args=(2, _free_port(), str(folder)), nprocs=2, join=True)
    return folder


@pytest.mark.distributed
def test_two_rank_dtensor_keeps_shards(two_ranks, tmp_path):
    full = torch.arange(6 * 3, dtype=torch.float32).reshape(6, 3) / 7
    md = read_metadata(str(two_ranks))
    assert sorted(c.offsets for c in md.entries["model.w"].chunks) == [(0, 0), (3, 0)]
    result = import_checkpoint(two_ranks, tmp_path / "repo" / "dtensor")
    with ckptfmt.open(result.url) as ckpt:
        info = ckpt.tensor_info("model/w")
        assert tuple(info.shape) == (6, 3)
        assert sorted((tuple(s.offsets), tuple(s.shape), s.rank) for s in info.shards) == \
            [((0, 0), (3, 3), 0), ((3, 0), (3, 3), 1)]
    loaded = ckptfmt.load(result.url)
    assert loaded["step"] == 5
    assert_bits(loaded["model"]["w"], full)


# --------------------------------------------------------------------------- damaged folders


def _no_checkpoint(repo: Path) -> None:
    assert not repo.exists() or ckptfmt.Repository.open(str(repo)).names() == []


def _copy(folder: Path, dest: Path) -> Path:
    dest.mkdir()
    for p in folder.iterdir():
        (dest / p.name).write_bytes(p.read_bytes())
    return dest


def test_missing_metadata(single, tmp_path):
    _, folder = single
    broken = _copy(folder, tmp_path / "nometa")
    (broken / ".metadata").unlink()
    assert detect_kind(str(broken)) == "dcp"
    with pytest.raises(CheckpointError, match=r"nometa/\.metadata"):
        import_checkpoint(broken, tmp_path / "repo" / "x")
    _no_checkpoint(tmp_path / "repo")


def test_truncated_distcp(single, tmp_path):
    _, folder = single
    broken = _copy(folder, tmp_path / "trunc")
    data_file = next(broken.glob("*.distcp"))
    data_file.write_bytes(data_file.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=rf"{data_file.name}.*truncated"):
        import_checkpoint(broken, tmp_path / "repo" / "x")
    _no_checkpoint(tmp_path / "repo")


def test_corrupt_distcp_item(single, tmp_path):
    _, folder = single
    broken = _copy(folder, tmp_path / "flip")
    md = read_metadata(str(broken))
    info = md.storage[("extra.ints", (0,))]
    path = broken / info.relative_path
    data = bytearray(path.read_bytes())
    end = info.offset + info.length
    at = data[info.offset:end].find(torch.arange(5, dtype=torch.int64).numpy().tobytes())  # the raw values
    assert at > 0
    data[info.offset + at + 8] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"{info.relative_path}.*extra.ints.*CRC-32 mismatch"):
        read_source(str(broken))


def test_metadata_names_missing_file(single, tmp_path):
    _, folder = single
    broken = _copy(folder, tmp_path / "missing")
    data_file = next(broken.glob("*.distcp"))
    data_file.unlink()
    with pytest.raises(CheckpointError, match=rf"{data_file.name}: no such file"):
        import_checkpoint(broken, tmp_path / "repo" / "x")
    _no_checkpoint(tmp_path / "repo")


def test_metadata_with_code_is_never_run(single, tmp_path):
    """A .metadata whose pickle calls os.system: refused, nothing called."""
    import pickle

    class Evil:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    broken = _copy(single[1], tmp_path / "evil")
    (broken / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(CheckpointError, match=r"evil/\.metadata"):
        import_checkpoint(broken, tmp_path / "repo" / "x")
    assert not (tmp_path / "pwned").exists()
    _no_checkpoint(tmp_path / "repo")
