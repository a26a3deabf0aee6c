"""``load(verify=...)``: every chunk hashed (the default), hashed once per unchanged local file in a
process (``"once"``), or never (``False``, sizes still checked)."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import ckptfmt
from ckptfmt.errors import CorruptDataError
from ckptfmt.format.chunk_table import stored_key
from ckptfmt.loading import verified_files
from ckptfmt.repository.repository import Repository
from ckptfmt.storage.local import LocalStorage


@pytest.fixture
def checkpoint(tmp_path):
    verified_files._seen.clear()  # a fresh process's memory
    url = ckptfmt.save({"w": torch.arange(200_000.0), "b": torch.ones(4)}, tmp_path / "run" / "a")
    repo = Repository.open(str(tmp_path / "run"))
    chunks = repo.manifest("a").chunks
    big = max(chunks, key=lambda chunk: chunk.size)
    return url, repo.storage.path(stored_key(chunks, big))


def hashes_counted(monkeypatch) -> list[str]:
    """The chunk hashes the reads check from now on."""
    counted: list[str] = []
    import ckptfmt.format.hashing as hashing
    real = hashing.check_chunk

    def counting(data, expected, where, **kwargs):
        counted.append(expected)
        return real(data, expected, where, **kwargs)
    for module in ("ckptfmt.loading.chunkio", "ckptfmt.repository.chunk_reads"):
        monkeypatch.setattr(f"{module}.check_chunk", counting)
    return counted


def flip_a_byte(path: str) -> None:
    with open(path, "r+b") as file:
        file.seek(1000)
        byte = file.read(1)
        file.seek(1000)
        file.write(bytes([byte[0] ^ 0xFF]))


def test_once_skips_the_files_verify_just_checked_and_rehashes_a_changed_one(checkpoint, monkeypatch):
    url, path = checkpoint
    assert ckptfmt.verify(os.path.dirname(url)).ok
    counted = hashes_counted(monkeypatch)
    assert torch.equal(ckptfmt.load(url, verify="once")["w"], torch.arange(200_000.0))
    assert counted == []  # every chunk file was checked by verify, and none changed since
    ckptfmt.load(url)
    assert len(counted) == 2  # the default hashes every chunk read, whatever was checked before
    flip_a_byte(path)  # its change time moves: not the file that was checked
    with pytest.raises(CorruptDataError, match="hash mismatch"):
        ckptfmt.load(url, verify="once")


def test_once_checks_a_file_the_first_time_and_remembers_it(checkpoint, monkeypatch):
    url, _ = checkpoint
    counted = hashes_counted(monkeypatch)
    ckptfmt.load(url, verify="once")
    assert len(counted) == 2
    with ckptfmt.open(url, verify="once") as reader:
        assert torch.equal(reader.get_tensor("w"), torch.arange(200_000.0))
    assert len(counted) == 2


def test_false_hashes_nothing_and_loads_damage_without_an_error(checkpoint, monkeypatch):
    url, path = checkpoint
    flip_a_byte(path)
    with pytest.raises(CorruptDataError, match="hash mismatch"):
        ckptfmt.load(url)
    counted = hashes_counted(monkeypatch)
    loaded = ckptfmt.load(url, verify=False)  # the risk the caller took: the damaged value, unnoticed
    assert counted == [] and not torch.equal(loaded["w"], torch.arange(200_000.0))


def test_compressed_chunks_follow_the_same_rules(tmp_path, monkeypatch):
    verified_files._seen.clear()
    url = ckptfmt.save({"w": torch.zeros(100_000)}, tmp_path / "run" / "a", compression="zstd")
    counted = hashes_counted(monkeypatch)
    ckptfmt.load(url, verify="once")
    first = len(counted)
    ckptfmt.load(url, verify="once")
    ckptfmt.load(url, verify=False)
    assert first >= 1 and len(counted) == first


def test_an_unknown_mode_is_refused(checkpoint):
    with pytest.raises(ValueError, match="verify must be True, 'once' or False"):
        ckptfmt.load(checkpoint[0], verify="sometimes")


def test_false_from_many_threads_at_once_gives_views_of_one_map_of_a_shared_chunk(tmp_path, monkeypatch):
    """Unverified maps are made without the hand-off a hashed one needs: threads asking for tensors of one
    chunk at the same moment may each map its file, but every view they get is of the one map kept."""
    state = {f"t{i}": torch.arange(64.0) + i for i in range(32)}  # small tensors: packed into one chunk
    url = ckptfmt.save(state, tmp_path / "run" / "a")
    real_map = LocalStorage.map

    def slow_map(self, key, size):  # every thread is mapping the pack at the same time
        time.sleep(0.05)
        return real_map(self, key, size)
    monkeypatch.setattr(LocalStorage, "map", slow_map)
    with ckptfmt.open(url, verify=False) as reader:
        pieces = {entry.key: entry.shards[0].pieces[0] for entry in reader.manifest.tensors}
        assert len({piece.chunk for piece in pieces.values()}) == 1
        with ThreadPoolExecutor(8) as pool:
            got = dict(zip(state, pool.map(reader.get_tensor, state)))
    assert all(torch.equal(got[key], value) for key, value in state.items())
    starts = {tensor.data_ptr() - pieces[key].offset for key, tensor in got.items()}
    assert len(starts) == 1  # the start of one map, whatever piece of it each view is
