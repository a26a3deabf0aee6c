"""``CheckpointManager(..., format_version=V)`` and ``ckptfmt.async_save(..., format_version=V)``: every save
path writes for readers of V (spec 13.3), copies to the next tiers keep V (manifests travel as bytes,
and a tier the copy creates gets the first tier's marker), and options V cannot express are refused
when the manager is made or the save is asked for, naming the version that first has them."""

from __future__ import annotations

import json

import msgpack
import pytest
import torch

import ckptfmt
from ckptfmt import CheckpointManager, Tier
from ckptfmt.format import layout
from ckptfmt.format.codecs import is_delta, is_float
from ckptfmt.lifecycle.signing import generate_key
from ckptfmt.repository.repository import Repository
from ckptfmt.storage.factory import open_storage
from tests.support.helpers import ANY_SIZE, assert_same


def state(step: int) -> dict:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(64, 1024, generator=g)  # 256 KiB: chunks of its own, compressed as floats where allowed
    return {"w": w + step * 1e-3, "h": (w[:32] + step).to(torch.bfloat16), "step": step}


def manifest_doc(url: str, name: str) -> dict:
    storage = open_storage(url)
    record = Repository(storage).commit(name)
    data = storage.read(layout.manifest_key(name, record.manifest_hash), max_size=ANY_SIZE)
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def marker_version(url: str) -> list[int]:
    return json.loads(open_storage(url).read(layout.MARKER_KEY, max_size=ANY_SIZE))["version"]


def codecs_of(doc: dict) -> set[str]:
    chunks = doc["chunks"]
    return set(chunks["codecs"]) if isinstance(chunks, dict) else {row["codec"] for row in chunks}


def assert_floor(url: str, names: list[str], version: tuple[int, int]) -> set[str]:
    """Every checkpoint of ``url`` (and its marker) is of ``version``, in its forms; the codecs used."""
    assert marker_version(url) == list(version)
    used: set[str] = set()
    for name in names:
        doc = manifest_doc(url, name)
        assert doc["version"] == list(version) and "requires" not in doc
        commit = json.loads(open_storage(url).read(layout.commit_key(name), max_size=ANY_SIZE))
        assert commit["version"] == list(version)
        assert isinstance(doc["chunks"], list) == (version < (1, 13))
        assert isinstance(doc["tensors"], list) == (version < (1, 12))
        used |= codecs_of(doc)
    assert not any(map(is_float, used)) or version >= (1, 11), used
    assert not any(map(is_delta, used)) or version >= (1, 5), used
    return used


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_manager_writes_the_floor_on_every_tier(async_save, tmp_path):
    fast, slow = str(tmp_path / "fast"), str(tmp_path / "slow")
    manager = CheckpointManager(tiers=[fast, slow], format_version="1.6", compression="auto", async_save=async_save,
                                housekeeping="thread", chunk_size=64 * 1024)
    try:
        for step in (1, 2, 3):
            manager.save(step, state(step))
        manager.wait()
    finally:
        manager.close()
    names = [f"step-{step:09d}" for step in (1, 2, 3)]
    used = assert_floor(fast, names, (1, 6))
    assert any(map(is_delta, used))  # "auto" stored deltas (1.5), never the float codecs (1.11)
    assert assert_floor(slow, names, (1, 6)) == used  # the next tier holds the same manifests, at 1.6
    for name in names:
        assert manifest_doc(fast, name) == manifest_doc(slow, name)
        assert_same(ckptfmt.load(f"{fast}/{name}"), ckptfmt.load(f"{slow}/{name}"))
    assert ckptfmt.verify(slow).ok


def test_manager_below_delta_codecs(tmp_path):
    repo = str(tmp_path / "repo")
    with CheckpointManager(repo, format_version=(1, 4), compression="auto", chunk_size=64 * 1024) as manager:
        for step in (1, 2):
            manager.save(step, state(step))
    used = assert_floor(repo, ["step-000000001", "step-000000002"], (1, 4))
    assert used <= {"none", "zstd", "shuffle2-zstd", "shuffle4-zstd", "shuffle8-zstd"}
    assert_same(ckptfmt.load(f"{repo}/step-000000002"), state(2))


def test_node_scoped_tier_keeps_its_version_on_the_shared_tier(tmp_path):
    node, shared = str(tmp_path / "node"), str(tmp_path / "shared")
    manager = CheckpointManager(tiers=[Tier(node, scope="node"), shared], format_version="1.10",
                                compression="zstd", housekeeping="thread")
    try:
        manager.save(1, state(1))
        manager.wait()
    finally:
        manager.close()
    assert_floor(node, ["step-000000001"], (1, 10))
    assert_floor(shared, ["step-000000001"], (1, 10))
    assert manifest_doc(shared, "step-000000001")["placement"] is not None


@pytest.mark.parametrize(("options", "needs"), [
    ({"format_version": "1.6", "compression": "float-zstd"}, "needs format 1.11"),
    ({"format_version": "1.4", "compression": "delta-zstd"}, "needs format 1.5"),
    ({"format_version": "1.6", "signer": "KEY"}, "needs format 1.7"),
    ({"format_version": "3.0"}, "cannot write format 3.0"),
    ({"format_version": "1.x"}, "not MAJOR.MINOR"),
])
def test_manager_and_async_save_refuse_what_the_version_cannot_express(options, needs, tmp_path):
    if options.get("signer") == "KEY":
        options = {**options, "signer": generate_key(tmp_path / "key")[0]}
    repo = str(tmp_path / "repo")
    with pytest.raises(ValueError, match=needs):
        CheckpointManager(repo, **options)
    with pytest.raises(ValueError, match=needs):
        ckptfmt.async_save(state(1), f"{repo}/a", **options)
    assert not open_storage(repo).exists(layout.MARKER_KEY)  # refused before anything was written


def test_manager_refuses_a_node_tier_below_placement_when_made(tmp_path):
    with pytest.raises(ValueError, match="scope='node' needs format 1.10"):
        CheckpointManager(tiers=[Tier(str(tmp_path / "node"), scope="node"), str(tmp_path / "shared")],
                          format_version="1.6")


def test_manager_refuses_a_bad_format_version_type(tmp_path):
    with pytest.raises(TypeError, match="format_version"):
        CheckpointManager(str(tmp_path / "repo"), format_version=1.6)


def test_async_save_writes_the_floor(tmp_path):
    repo = str(tmp_path / "repo")
    ckptfmt.async_save(state(1), f"{repo}/a", format_version="1.6", compression="shuffle-zstd").result()
    ckptfmt.async_save(state(2), f"{repo}/b", format_version="1.6", compression="delta-zstd").result()
    used = assert_floor(repo, ["a", "b"], (1, 6))
    assert "shuffle4-zstd" in used and any(map(is_delta, used))
    assert_same(ckptfmt.load(f"{repo}/b"), state(2))
    assert ckptfmt.verify(repo).ok
