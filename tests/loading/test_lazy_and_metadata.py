"""ckptfmt.open: lazy per-tensor reads, and the run metadata every checkpoint records."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import socket
import subprocess
import time

import numpy as np
import pytest
import torch

import ckptfmt
from ckptfmt import CheckpointNotFoundError
from ckptfmt.format import layout
from ckptfmt.storage.base import Storage
from ckptfmt.storage.factory import open_storage
from ckptfmt.storage.local import LocalStorage
from tests.support.helpers import assert_same, assert_tensor_exact, tensor_chunk_keys


def lazy_state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "model": {
            "embed": torch.randn(300, 256, generator=g),  # 300 KB: chunks of its own
            "proj": torch.randn(512, 300, generator=g).to(torch.bfloat16),  # 300 KB too
            "norm": torch.ones(256),  # small: packed with the other small tensors
            "bias": torch.zeros(7, dtype=torch.float64),
        },
        "array": np.arange(100_000, dtype=np.int32),
        "step": 12,
    }


@pytest.fixture
def saved(repo_url):
    state = lazy_state()
    url = ckptfmt.save(state, f"{repo_url}/lazy", step=12, chunk_size=65536)
    return url, state


def test_open_as_context_manager(saved):
    url, state = saved
    with ckptfmt.open(url) as reader:
        assert isinstance(reader, ckptfmt.CheckpointReader)
        assert reader.keys() == ["model/embed", "model/proj", "model/norm", "model/bias", "array"]
        assert "model/embed" in reader and "model/nope" not in reader
        assert reader.name == "lazy"
        assert reader.url == url
        assert len(reader.id) == 64
        info = reader.tensor_info("model/proj")
        assert (info.dtype, info.shape) == ("bfloat16", (512, 300))
        for key, value in [("model/embed", state["model"]["embed"]), ("model/norm", state["model"]["norm"]),
                           ("model/proj", state["model"]["proj"])]:
            assert_tensor_exact(value, reader.get_tensor(key), key)
        array = reader.get_tensor("array")
        assert isinstance(array, np.ndarray) and np.array_equal(array, state["array"])
        with pytest.raises(CheckpointNotFoundError, match="model/nope"):
            reader.get_tensor("model/nope")
        assert_same(state, reader.load_state())


@pytest.fixture
def read_log(monkeypatch):
    """Every storage key read, on every backend."""
    keys: list[str] = []
    for cls in (Storage, LocalStorage):
        for method in ("read", "read_into", "map"):
            original = cls.__dict__[method]

            def wrapper(self, key, *args, _original=original, **kwargs):
                result = _original(self, key, *args, **kwargs)
                if result is not None or _original.__name__ != "map":  # map() returns None where it cannot map
                    keys.append(key)
                return result

            monkeypatch.setattr(cls, method, wrapper)
    return keys


def chunk_reads(log: list[str]) -> set[str]:
    return {k for k in log if k.startswith(layout.CHUNKS_DIR + "/")}


@pytest.mark.parametrize("key", ["model/embed", "model/proj", "model/norm", "array"])
def test_get_tensor_reads_only_that_tensors_chunks(saved, read_log, key):
    url, state = saved
    with ckptfmt.open(url) as reader:
        assert chunk_reads(read_log) == set()  # opening reads the commit and manifest only
        wanted = tensor_chunk_keys(reader, key)
        reader.get_tensor(key)
        assert chunk_reads(read_log) == wanted
        if key in ("model/embed", "model/proj"):
            assert len(wanted) > 1  # split across several chunks, all of them read
        # ... and each at most once.
        assert len([k for k in read_log if k in wanted]) == len(wanted)


def test_get_tensor_works_when_other_tensors_chunks_are_gone(saved):
    url, state = saved
    with ckptfmt.open(url) as reader:
        embed_chunks = tensor_chunk_keys(reader, "model/embed")
        others = set().union(*(tensor_chunk_keys(reader, k) for k in reader.keys() if k != "model/embed"))
    assert not embed_chunks & others
    storage = open_storage(url.rsplit("/", 1)[0])
    for key in others:
        storage.delete(key)
    with ckptfmt.open(url) as reader:
        assert_tensor_exact(state["model"]["embed"], reader.get_tensor("model/embed"))
        with pytest.raises(CheckpointNotFoundError, match="chunk is missing"):
            reader.get_tensor("model/proj")
        with pytest.raises(CheckpointNotFoundError):
            reader.load_state()


def test_load_state_without_entries_leaves_them_out_unread(saved):
    """The rest of a checkpoint whose model was loaded some other way (in place, sharded): the model's
    chunks are not read, so their loss does not matter."""
    url, state = saved
    with ckptfmt.open(url) as reader:
        model_chunks = set().union(*(tensor_chunk_keys(reader, k) for k in reader.keys() if k.startswith("model/")))
        assert not model_chunks & tensor_chunk_keys(reader, "array")
    storage = open_storage(url.rsplit("/", 1)[0])
    for key in model_chunks:
        storage.delete(key)
    with ckptfmt.open(url) as reader:
        rest = reader.load_state(without=["model", "absent"])
        assert list(rest) == ["array", "step"] and rest["step"] == 12
        np.testing.assert_array_equal(rest["array"], state["array"])
        with pytest.raises(CheckpointNotFoundError):
            reader.load_state()


def test_load_state_without_keeps_a_tensor_shared_with_what_is_left_out(tmp_path):
    shared = torch.arange(6.0)
    url = ckptfmt.save({"model": {"w": shared}, "ema": {"w": shared, "decay": 0.99}}, tmp_path / "run" / "a")
    with ckptfmt.open(url) as reader:
        rest = reader.load_state(without={"model"})
    assert list(rest) == ["ema"] and rest["ema"]["decay"] == 0.99
    assert_tensor_exact(shared, rest["ema"]["w"])


def test_load_state_without_needs_a_dict_state(tmp_path):
    url = ckptfmt.save([torch.ones(2), 3], tmp_path / "run" / "a")
    with ckptfmt.open(url) as reader, pytest.raises(ckptfmt.CheckpointError,
                                                    match=r"without=\.\.\.\) needs a state that is a dict, not a list"):
        reader.load_state(without=["model"])


def test_metadata(repo_url, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    before = time.time_ns()
    step_times = [0.25, 0.5, 0.125]
    user = {"lr": 3e-4, "tags": ("baseline", "v2"), 7: None, "notes": b"\x00bytes"}
    ckptfmt.save({"w": torch.ones(3)}, f"{repo_url}/first", step=10)
    ckptfmt.save({"w": torch.zeros(300_000, dtype=torch.uint8)}, f"{repo_url}/meta", step=20, metadata=user,
                 step_times=step_times, parallelism={"dp": 2, "tp": 2})
    after = time.time_ns()
    with ckptfmt.open(f"{repo_url}/meta") as reader:
        meta = reader.metadata

    assert meta["name"] == "meta"
    assert meta["step"] == 20
    assert meta["parent"] == "first"
    assert meta["format_version"] == list(ckptfmt.FORMAT_VERSION)
    assert before <= meta["created_ns"] <= after
    assert_same(user, meta["user"])

    env = meta["environment"]
    assert env["python"]["version"] == platform.python_version()
    assert env["torch"]["version"] == torch.__version__
    assert env["hostname"] == socket.gethostname()
    assert env["packages"]["torch"] == importlib.metadata.version("torch")
    assert env["packages"]["numpy"] == np.__version__
    assert env["cpu"]["count"] == os.cpu_count()
    assert "deterministic_algorithms" in env["determinism"] and "cudnn_benchmark" in env["determinism"]

    rng = meta["rng"]
    assert [r["rank"] for r in rng] == [1]
    assert isinstance(rng[0]["torch_cpu"], bytes) and len(rng[0]["torch_cpu"]) == torch.get_rng_state().numel()

    topo = meta["topology"]
    assert topo["world_size"] == 4
    assert topo["writer_ranks"] == [1]
    assert topo["ranks"][0]["rank"] == 1 and topo["ranks"][0]["local_rank"] == 1
    assert topo["ranks"][0]["host"] == socket.gethostname()
    assert topo["parallelism"] == {"dp": 2, "tp": 2}

    timing = meta["timing"]
    assert timing["steps"] == step_times
    (rank,) = timing["ranks"]
    assert rank["rank"] == 1 and rank["host"] == socket.gethostname()
    names = [p["name"] for p in rank["phases"]]
    assert names == ["prepare", "lease", "write_chunks", "sync", "environment"]
    for phase in rank["phases"]:
        assert before <= phase["start_ns"] <= after
        assert 0 <= phase["duration_s"] <= rank["total_s"]
    starts = [p["start_ns"] for p in rank["phases"]]
    assert starts == sorted(starts)
    assert sum(p["duration_s"] for p in rank["phases"]) <= rank["total_s"]

    stats = meta["stats"]
    assert stats["tensor_count"] == 1 and stats["tensor_bytes"] == 300_000
    assert stats["new_bytes"] == 300_000 and stats["stored_bytes"] == 300_000

    # restore_rng defaults to this process's rank.
    ckptfmt.restore_rng(f"{repo_url}/meta")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(CheckpointNotFoundError):
        ckptfmt.restore_rng(f"{repo_url}/meta")


def test_default_topology_and_parallelism(repo_url, monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    ckptfmt.save({}, f"{repo_url}/solo")
    meta = ckptfmt.open(f"{repo_url}/solo").metadata
    assert meta["topology"]["world_size"] == 1
    assert meta["topology"]["parallelism"] == {"dp": 1}
    assert meta["step"] is None
    assert meta["user"] == {}
    assert meta["timing"]["steps"] == []


def test_determinism_flags_are_read_at_each_save(tmp_path):
    repo = tmp_path / "repo"
    assert not torch.are_deterministic_algorithms_enabled()
    ckptfmt.save({}, repo / "loose")
    torch.use_deterministic_algorithms(True)
    try:
        ckptfmt.save({}, repo / "strict")
    finally:
        torch.use_deterministic_algorithms(False)
    loose = ckptfmt.open(repo / "loose").metadata["environment"]["determinism"]
    strict = ckptfmt.open(repo / "strict").metadata["environment"]["determinism"]
    assert loose["deterministic_algorithms"] is False
    assert strict["deterministic_algorithms"] is True
    assert strict["num_threads"] == torch.get_num_threads()


def test_git_state_of_the_working_directory(tmp_path, monkeypatch):
    work = tmp_path / "project"
    work.mkdir()

    def git(*args):
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *args],
                              cwd=work, check=True, capture_output=True, text=True).stdout.strip()

    git("init", "-q")
    (work / "train.py").write_text("print('hi')\n")
    git("add", "train.py")
    git("commit", "-q", "-m", "init")
    head = git("rev-parse", "HEAD")
    monkeypatch.chdir(work)
    ckptfmt.save({}, tmp_path / "repo" / "g")
    assert ckptfmt.open(tmp_path / "repo" / "g").metadata["environment"]["git"] == {"commit": head, "dirty": False}

    outside = tmp_path / "not-a-repo"
    outside.mkdir()
    monkeypatch.chdir(outside)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    ckptfmt.save({}, tmp_path / "repo" / "h")
    assert ckptfmt.open(tmp_path / "repo" / "h").metadata["environment"]["git"] is None


def test_converters_can_record_foreign_rng_states_and_provenance(tmp_path):
    """save(rng=..., provenance=...) stores another tool's RNG states and the import's origin."""
    import random

    torch.manual_seed(1234)
    random.seed(99)
    from ckptfmt.metadata.rng import capture_rng

    foreign = [capture_rng(0)]
    expected = (torch.rand(3), random.random())
    torch.manual_seed(0)
    random.seed(0)
    provenance = {"source_kind": "torch", "source": "/data/model.pt", "versions": {"torch": "2.1.0"}}
    url = ckptfmt.save({"w": torch.ones(2)}, tmp_path / "repo" / "imported", rng=foreign, provenance=provenance)
    with ckptfmt.open(url) as reader:
        assert reader.metadata["provenance"] == provenance
        ckptfmt.restore_rng(reader)
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1]
    plain = ckptfmt.save({"w": torch.ones(2)}, tmp_path / "repo" / "direct")
    assert ckptfmt.open(plain).metadata["provenance"] is None


def test_package_versions_are_those_importlib_parses():
    """The environment reads only the Name and Version headers of each distribution (fast), and finds
    what importlib.metadata's full parse finds (the first distribution of a name, as imports do)."""
    import importlib.metadata

    from ckptfmt.metadata.environment import _packages

    expected: dict[str, str] = {}
    for dist in importlib.metadata.distributions():
        if dist.metadata.get("Name"):
            expected.setdefault(dist.metadata["Name"].lower(), dist.version)
    assert _packages() == dict(sorted(expected.items())) and "torch" in expected


def test_listing_keys_builds_no_index_and_lookups_build_it_once(tmp_path):
    """``keys()`` gives the save order from the tensor table (a fresh list each time) without indexing
    the keys: 100,000 of them took 15 ms to index, more than a third of an open and listing. The first
    lookup builds the index; a missing key still gets its "did you mean"."""
    state = {f"layer{i}.w": torch.full((2,), float(i)) for i in range(300)}
    ckptfmt.save(state, tmp_path / "repo" / "a")
    with ckptfmt.open(tmp_path / "repo" / "a") as ckpt:
        keys = ckpt.keys()
        assert keys == list(state) and ckpt._index is None
        keys.append("not there")
        assert ckpt.keys() == list(state)
        assert "layer299.w" in ckpt and "not there" not in ckpt and ckpt._index is not None
        assert torch.equal(ckpt.get_tensor("layer7.w"), state["layer7.w"])
        with pytest.raises(CheckpointNotFoundError, match="did you mean 'layer7.w'"):
            ckpt.get_tensor("layer7.W")
