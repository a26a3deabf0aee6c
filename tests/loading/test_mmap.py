"""Memory-mapped loads: zero-copy, verified at map time, private to the process."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch

import ckptfmt
from ckptfmt import CorruptDataError
from ckptfmt.format import layout
from tests.support.helpers import assert_same

CHUNK_SIZE = 2**20
#: The tensors of ``saved`` that lie whole in one uncompressed chunk: loads map them.
MAPPED = ("big", "small", "half")


@pytest.fixture
def saved(tmp_path):
    torch.manual_seed(0)
    state = {
        "big": torch.randn(512, 256),                      # 512 KiB: a chunk of its own
        "small": torch.arange(10, dtype=torch.int16),      # below 256 KiB: packed with the next one
        "half": torch.randn(7, dtype=torch.bfloat16),
        "split": torch.randn(400_000),                     # 1.6 MB: two chunks, read into fresh memory
        "empty": torch.empty(0, 3),
    }
    url = ckptfmt.save(state, tmp_path / "repo" / "c", chunk_size=CHUNK_SIZE)
    return tmp_path / "repo", url, state


def chunk_files(repo: Path, url) -> dict[str, list[Path]]:
    """Each tensor's chunk files, in the order of its pieces."""
    with ckptfmt.open(url) as reader:
        chunks = reader.manifest.chunks
        return {entry.key: [repo / layout.chunk_key(chunks[p.chunk].hash, chunks[p.chunk].codec)
                            for shard in entry.shards for p in shard.pieces] for entry in reader.manifest.tensors}


def file_mappings() -> list[tuple[int, int, str, str]]:
    """(start, end, permissions, path) of every file mapped into this process, from /proc/self/maps."""
    mappings = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith("/"):
            start, end = (int(address, 16) for address in fields[0].split("-"))
            mappings.append((start, end, fields[1], fields[5]))
    return mappings


def mapped_from(tensor: torch.Tensor, mappings) -> tuple[str, str] | None:
    """(path, permissions) of the file mapping that holds all of ``tensor``'s bytes, or None."""
    first, last = tensor.data_ptr(), tensor.data_ptr() + tensor.numel() * tensor.element_size()
    return next(((path, perms) for start, end, perms, path in mappings if start <= first and last <= end), None)


needs_proc_maps = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux's /proc/self/maps")


@needs_proc_maps
def test_tensors_in_one_uncompressed_chunk_are_views_of_its_mapped_file(saved):
    """Zero copy: each such tensor's memory lies in a private mapping of its own chunk file; the others
    (several chunks, no bytes) live in memory of their own, as does everything with mmap=False."""
    repo, url, state = saved
    files = chunk_files(repo, url)
    assert [len(files[key]) for key in MAPPED] == [1, 1, 1] and len(files["split"]) == 2
    expected = {key: (str(files[key][0]), "rw-p") if key in MAPPED else None for key in state}  # rw-p: private
    loaded = ckptfmt.load(url)
    mappings = file_mappings()
    assert {key: mapped_from(loaded[key], mappings) for key in state} == expected
    with ckptfmt.open(url) as reader:
        big = reader.get_tensor("big")
        assert mapped_from(big, file_mappings()) == expected["big"]
    copied = ckptfmt.load(url, mmap=False)
    mappings = file_mappings()
    assert {key: mapped_from(copied[key], mappings) for key in state} == dict.fromkeys(state)


def test_mapped_and_copied_loads_are_equal(saved):
    _, url, state = saved
    assert_same(state, ckptfmt.load(url))
    assert_same(state, ckptfmt.load(url, mmap=False))


def test_writes_to_a_mapped_tensor_stay_private(saved):
    _, url, state = saved
    loaded = ckptfmt.load(url)
    loaded["big"].add_(1.0)
    loaded["small"][0] = 99
    assert ckptfmt.verify(url).ok
    assert_same(state, ckptfmt.load(url))


def test_mapped_tensors_outlive_their_files(saved):
    repo, url, state = saved
    loaded = ckptfmt.load(url)
    shutil.rmtree(repo)
    assert_same(state, loaded)


def test_a_damaged_chunk_is_caught_when_mapped(saved):
    repo, url, _ = saved
    with ckptfmt.open(url) as reader:
        chunk = reader.manifest.chunks[reader.tensor_info("big").shards[0].pieces[0].chunk]
    path = repo / layout.chunk_key(chunk.hash, chunk.codec)
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptDataError, match=chunk.hash[:16]):
        ckptfmt.load(url)
    with ckptfmt.open(url) as reader:
        with pytest.raises(CorruptDataError):
            reader.get_tensor("big")
        assert torch.equal(reader.get_tensor("split"), saved[2]["split"])
