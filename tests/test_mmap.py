"""Memory-mapped loads: zero-copy, verified at map time, private to the process."""

from __future__ import annotations

import shutil

import pytest
import torch

import ckptfmt
from ckptfmt import CorruptDataError, layout
from helpers import assert_same


@pytest.fixture
def saved(tmp_path):
    torch.manual_seed(0)
    state = {
        "big": torch.randn(512, 256),                      # its own chunk
        "small": torch.arange(10, dtype=torch.int16),      # packed with the next one
        "half": torch.randn(7, dtype=torch.bfloat16),
        "split": torch.randn(40_000),                      # several chunks: read into fresh memory
        "empty": torch.empty(0, 3),
    }
    url = ckptfmt.save(state, tmp_path / "repo" / "c", chunk_size=65536)
    return tmp_path / "repo", url, state


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
