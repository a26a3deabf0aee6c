"""What a save stores is what it names, and what it reuses is as durable as what it writes.

A chunk is named after the BLAKE3 of its bytes, and later saves trust a chunk
because it exists: a save must never store bytes other than the ones it
hashed, even while another thread keeps changing the tensor (what an
asynchronous save will face). A chunk found already stored but not vouched for
by a committed checkpoint (a killed save left it) is made durable before the
new checkpoint commits.
"""

from __future__ import annotations

import os
import shutil
import threading

import pytest
import torch

import ckptfmt
from ckptfmt.format import layout
from ckptfmt.repository.repository import Repository
from ckptfmt.saving import pipeline
from ckptfmt.saving.hashcache import HashCache
from ckptfmt.storage.local import LocalStorage
from tests.support.helpers import assert_same


def test_a_tensor_changing_during_the_save_is_stored_as_hashed(repo_url):
    """A thread fills the tensor with new values while it is saved: every stored chunk still matches its
    name, and each holds values of the fills that ran while it was copied."""
    tensor = torch.zeros(16 * 2**20 // 4)
    stop, running = threading.Event(), threading.Event()
    fills = [0]  # fill N writes the value N; fills[0] is the latest begun

    def mutate():
        running.set()
        while not stop.is_set():
            fills[0] += 1
            tensor.fill_(fills[0])

    mutator = threading.Thread(target=mutate)
    mutator.start()
    saves = []  # (url, the fill begun when the save started, the fill begun when it returned)
    try:
        assert running.wait(60)
        for i in range(3):
            started = fills[0]
            url = ckptfmt.save({"t": tensor}, f"{repo_url}/s{i}", chunk_size=2**20)
            saves.append((url, started, fills[0]))
    finally:
        stop.set()
        mutator.join()
    assert all(ended > started for _, started, ended in saves), saves  # the tensor changed during each save
    report = ckptfmt.verify(repo_url)
    assert report.ok, report.problems
    for url, started, ended in saves:
        loaded = ckptfmt.load(url, mmap=False)["t"]
        for chunk in loaded.split(2**20 // 4):  # at most the values of two consecutive fills per chunk
            values = torch.unique(chunk)
            assert len(values) <= 2 and (len(values) == 1 or values[1] - values[0] == 1), values
            assert started - 1 <= values[0] and values[-1] <= ended, (values, started, ended)


@pytest.fixture
def fsyncs(monkeypatch):
    """The paths os.fsync is called on (files and folders), in order."""
    calls: list[str] = []
    real_fsync = os.fsync

    def record(fd):
        calls.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", record)
    return calls


def chunk_files(repo) -> set[str]:
    return {str(p) for p in (repo / layout.CHUNKS_DIR).rglob("*") if p.is_file()}


def test_chunks_left_by_a_killed_save_are_made_durable_when_reused(tmp_path, fsyncs):
    repo = tmp_path / "repo"
    state = {"w": torch.randn(300_000), "v": torch.arange(100_000), "small": torch.ones(3)}
    ckptfmt.save(state, repo / "a")
    shutil.rmtree(repo / "a")  # as if the save had died before its commit: its chunks stay, vouched by nothing
    leftovers = chunk_files(repo)
    fsyncs.clear()
    ckptfmt.save(state, repo / "b")
    assert ckptfmt.open(repo / "b").manifest.totals["new_bytes"] == 0  # every chunk reused
    synced = set(fsyncs)
    assert leftovers <= synced, "reused chunk files not fsynced"
    folders = {os.path.dirname(p) for p in leftovers}
    assert folders | {str(repo / layout.CHUNKS_DIR), str(repo)} <= synced, "their folders not fsynced"
    assert_same(state, ckptfmt.load(repo / "b"))


def test_a_leftover_chunk_whose_bytes_never_reached_the_disk_is_written_again(tmp_path):
    """Chunks are renamed into place before their fsync (all are synced before the manifest): a save
    killed in between, then a power loss, can leave a chunk of the right size whose bytes are not its
    name's. A save must not reuse it on trust."""
    repo = tmp_path / "repo"
    state = {"w": torch.randn(300_000)}
    ckptfmt.save(state, repo / "a")
    shutil.rmtree(repo / "a")  # never committed
    (leftover,) = chunk_files(repo)
    with open(leftover, "r+b") as file:
        file.write(bytes(4096))  # a block lost in the crash
    ckptfmt.save(state, repo / "b")
    assert ckptfmt.open(repo / "b").manifest.totals["new_bytes"] == 300_000 * 4  # written again
    assert ckptfmt.verify(str(repo / "b")).ok
    assert_same(state, ckptfmt.load(repo / "b"))


def test_chunks_are_synced_once_all_are_written(tmp_path, fsyncs):
    """One pass of fsyncs after the writes (faster than one per chunk as it is written), before the manifest."""
    repo = tmp_path / "repo"
    ckptfmt.save({f"w{i}": torch.randn(2**18) for i in range(6)}, repo / "a", chunk_size=2**20)
    chunks = chunk_files(repo)
    first_sync = min(i for i, path in enumerate(fsyncs) if path in chunks)
    store = str(repo / layout.CHUNKS_DIR)
    assert not [path for path in fsyncs[:first_sync] if path.startswith(store)]  # none while writing
    manifest = next(i for i, path in enumerate(fsyncs) if "manifest-" in path)
    assert all(fsyncs.index(path) < manifest for path in chunks)


def test_chunks_of_a_committed_parent_are_not_synced_again(tmp_path, fsyncs):
    repo = tmp_path / "repo"
    state = {"w": torch.randn(300_000), "v": torch.arange(100_000)}
    ckptfmt.save(state, repo / "a")
    fsyncs.clear()
    state["v"] = state["v"] + 1
    ckptfmt.save(state, repo / "b")
    parent_chunks = {str(repo / key) for key in _keys(repo, "a")}
    assert not parent_chunks & set(fsyncs)
    assert _keys(repo, "a") & _keys(repo, "b"), "the unchanged tensor reuses the parent's chunk"


def _keys(repo, name: str) -> set[str]:
    return {layout.chunk_key(c.hash, c.codec) for c in Repository.open(repo).manifest(name).chunks}


def test_first_save_of_a_new_process_reuses_the_parents_chunks_without_writing(tmp_path, monkeypatch):
    """No fingerprints are cached in a fresh process: the parent's chunks are found by hashing the caller's
    bytes, and only the changed tensor is copied and written."""
    repo = tmp_path / "repo"
    state = {"w": torch.randn(2**20), "v": torch.randn(2**20)}
    ckptfmt.save(state, repo / "a", chunk_size=2**20)
    monkeypatch.setattr(pipeline, "DEFAULT_CACHE", HashCache())  # what a new process starts with
    staged = []
    real_stage = LocalStorage.stage
    monkeypatch.setattr(LocalStorage, "stage", lambda self, directory: staged.append(directory)
                        or real_stage(self, directory))
    state["v"] = state["v"] * 2
    url = ckptfmt.save(state, repo / "b", chunk_size=2**20)
    assert len(staged) == 4  # the four chunks of v; w's four are the parent's
    with ckptfmt.open(url) as ckpt:
        assert ckpt.manifest.totals["new_bytes"] == state["v"].numel() * 4
    assert_same(state, ckptfmt.load(url))
    assert not [p for p in (repo / layout.CHUNKS_DIR).rglob(".*")], "staged files left behind"
