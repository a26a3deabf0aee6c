"""Crash safety: a save killed at any moment, or failing with an error, never damages the repository."""

from __future__ import annotations

import errno
import itertools
import os
import re
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import ckptfmt
from ckptfmt import CheckpointNotFoundError, StorageError, layout
from ckptfmt.repository import Repository
from ckptfmt import storage as storage_module
from ckptfmt.storage import LocalStorage, open_storage

from helpers import assert_same, chunk_keys

# Each saved state is 4 x 16 MiB of int32, different at every step, in 4 MiB chunks:
# a save takes a noticeable moment, so a kill lands in the middle of one.
ELEMENTS = 4 * 2**20
CHUNK_SIZE = 4 * 2**20

WRITER = textwrap.dedent(
    """
    import sys, torch, ckptfmt
    repo, first = sys.argv[1], int(sys.argv[2])
    base = torch.arange({elements}, dtype=torch.int32)
    step = first
    while True:
        state = {{"step": step, **{{f"w{{k}}": base * (k + 1) + step for k in range(4)}}}}
        ckptfmt.save(state, f"{{repo}}/step-{{step}}", step=step, chunk_size={chunk_size})
        step += 1
    """
).format(elements=ELEMENTS, chunk_size=CHUNK_SIZE)


def expected_state(step: int) -> dict:
    base = torch.arange(ELEMENTS, dtype=torch.int32)
    return {"step": step, **{f"w{k}": base * (k + 1) + step for k in range(4)}}


def committed_steps(repo: Path) -> list[int]:
    return sorted(int(n.split("-")[1]) for n in Repository.open(repo).names())


def referenced_chunks(repo: Path) -> set[str]:
    repository = Repository.open(repo)
    return {layout.chunk_key(c.hash, c.codec) for n in repository.names() for c in repository.manifest(n).chunks}


def run_and_kill(repo: Path, first: int, delay: float, *, mid_chunks: bool = False) -> None:
    """Start a writer saving step-FIRST, step-FIRST+1, ...; SIGKILL it ``delay`` s after its first
    commit (with ``mid_chunks``: once the next save has stored some of its chunks)."""
    child = subprocess.Popen([sys.executable, "-c", WRITER, str(repo), str(first)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def wait_for(condition, what: str) -> None:
        deadline = time.monotonic() + 120
        while not condition():
            if child.poll() is not None:
                raise AssertionError(f"writer exited early: {child.stderr.read().decode()[-2000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"writer never {what}")
            time.sleep(0.002)

    try:
        wait_for((repo / f"step-{first}" / layout.COMMIT_NAME).exists, "committed its first checkpoint")
        if mid_chunks:
            known = chunk_keys(str(repo))
            wait_for(lambda: len(chunk_keys(str(repo)) - known) >= 2, "stored chunks of its second save")
        time.sleep(delay)
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=30) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        child.stderr.close()


@pytest.mark.slow
def test_sigkill_during_saves_leaves_committed_checkpoints_intact(tmp_path):
    repo = tmp_path / "repo"
    rng = random.Random(20240601)
    # Kill right after a commit, in the middle of writing chunks, and at random moments.
    rounds = [dict(delay=0.0), dict(delay=0.0, mid_chunks=True), dict(delay=rng.uniform(0.02, 0.3))]
    try:
        next_step = 0
        for kill in rounds:
            run_and_kill(repo, next_step, **kill)
            steps = committed_steps(repo)
            assert steps == list(range(steps[-1] + 1)), "commits are contiguous: nothing lost"
            assert steps[-1] >= next_step
            partial = steps[-1] + 1  # the save that was killed
            if kill.get("mid_chunks"):
                assert chunk_keys(str(repo)) - referenced_chunks(repo), "the kill left a save half done"
            assert f"step-{partial}" not in Repository.open(repo).names()
            with pytest.raises(CheckpointNotFoundError):
                ckptfmt.load(repo / f"step-{partial}")
            with pytest.raises(CheckpointNotFoundError):
                ckptfmt.open(repo / f"step-{partial}")
            assert ckptfmt.verify(repo).ok
            # The next writer re-uses the interrupted name: leftovers must not get in its way.
            next_step = partial

        report = ckptfmt.verify(repo)
        assert report.ok, report.problems
        assert report.checkpoints == sorted(f"step-{s}" for s in committed_steps(repo))
        for step in committed_steps(repo):
            assert_same(expected_state(step), ckptfmt.load(repo / f"step-{step}"))
        assert ckptfmt.load(repo)["step"] == committed_steps(repo)[-1]

        # A new save into the same repository, under the interrupted name, succeeds.
        state = {"step": next_step, "w": torch.arange(10)}
        ckptfmt.save(state, repo / f"step-{next_step}")
        assert_same(state, ckptfmt.load(repo / f"step-{next_step}"))
        assert ckptfmt.verify(repo).ok
    finally:
        shutil.rmtree(repo, ignore_errors=True)  # hundreds of MB: do not leave it to pytest's rotation


# -- a save that fails with an error ----------------------------------------------------


def fail_writes(monkeypatch, storage_url: str, where: str) -> list[str]:
    """Make writes of one kind of key ('chunks/', 'manifest-', 'COMMIT') fail like a full disk."""
    failed: list[str] = []

    def should_fail(path: str) -> bool:
        name = re.sub(r"^\.(.*)\.tmp-[0-9a-f]{12}$", r"\1", path.rsplit("/", 1)[-1])  # a local temp file's key
        return (f"/{layout.CHUNKS_DIR}/" in path if where == "chunk"
                else name.startswith("manifest-") if where == "manifest" else name == layout.COMMIT_NAME)

    def disk_full(path):
        failed.append(path)
        raise OSError(errno.ENOSPC, "No space left on device", path)

    original_write = storage_module._write_all

    def write_all(fd, data):  # every local write, to a temporary file beside its key
        path = os.readlink(f"/proc/self/fd/{fd}")
        if should_fail(path):
            disk_full(path)
        return original_write(fd, data)

    monkeypatch.setattr(storage_module, "_write_all", write_all)
    storage = open_storage(storage_url)
    if not isinstance(storage, LocalStorage):  # memory:// and S3 write through fsspec
        original_pipe = storage.fs.pipe_file

        def pipe_file(path, *args, **kwargs):
            if should_fail(path):
                disk_full(path)
            return original_pipe(path, *args, **kwargs)

        monkeypatch.setattr(storage.fs, "pipe_file", pipe_file)
    return failed


@pytest.mark.parametrize("where", ["chunk", "manifest", "commit"])
def test_failed_save_leaves_earlier_checkpoints_intact_and_itself_invisible(repo_url, monkeypatch, where):
    earlier = {"w": torch.randn(100_000), "small": torch.arange(5)}
    ckptfmt.save(earlier, f"{repo_url}/earlier")
    new = {"w": torch.randn(100_000), "v": torch.randn(90_000), "small": torch.arange(6)}

    failed = fail_writes(monkeypatch, repo_url, where)
    with pytest.raises(StorageError, match="No space left") as info:
        ckptfmt.save(new, f"{repo_url}/new", chunk_size=65536)
    assert isinstance(info.value, OSError)
    assert failed, "the failure was injected"
    monkeypatch.undo()

    repo = Repository.open(repo_url)
    assert repo.names() == ["earlier"]
    with pytest.raises(CheckpointNotFoundError):
        ckptfmt.load(f"{repo_url}/new")
    assert_same(earlier, ckptfmt.load(f"{repo_url}/earlier"))
    assert_same(earlier, ckptfmt.load(repo_url))
    assert ckptfmt.verify(repo_url).ok

    # Once the problem is gone, the same save succeeds.
    ckptfmt.save(new, f"{repo_url}/new", chunk_size=65536)
    assert_same(new, ckptfmt.load(f"{repo_url}/new"))
    assert ckptfmt.verify(repo_url).ok


def test_failed_chunk_write_stops_the_save_with_many_chunks(tmp_path, monkeypatch):
    """The writer's thread pool stops at the first error and reports it, even with far more jobs than
    workers: the jobs running when a write fails finish, no other starts."""
    repo = tmp_path / "repo"
    writes = itertools.count(1)
    calls = []
    original = storage_module._write_all

    def flaky(fd, data):
        calls.append(next(writes))
        if calls[-1] == 5:
            raise OSError(errno.EIO, "I/O error")
        return original(fd, data)

    monkeypatch.setattr(storage_module, "_write_all", flaky)
    state = {f"t{i}": torch.full((70_000,), i, dtype=torch.int32) for i in range(40)}  # 5 chunks each
    with pytest.raises(StorageError, match="I/O error"):
        ckptfmt.save(state, repo / "x", chunk_size=65536, workers=2)
    # Carrying on would write all 200 chunks; stopping leaves 5 or 6 (a bound far from both: a worker
    # descheduled while failing lets the other run on a little)
    assert len(calls) < 100, len(calls)
    assert Repository.open(repo).names() == []
    assert not (repo / "x" / layout.COMMIT_NAME).exists()


def test_leftover_temp_files_are_ignored(tmp_path):
    """Temp files of a killed local write sit beside real keys; readers and verify ignore them."""
    repo = tmp_path / "repo"
    state = {"w": torch.arange(100_000)}
    ckptfmt.save(state, repo / "a")
    chunk_dir = next((repo / layout.CHUNKS_DIR).iterdir())
    (chunk_dir / ".deadbeef.tmp-123456789abc").write_bytes(b"partial")
    (repo / "b").mkdir()
    (repo / "b" / ".COMMIT.tmp-123456789abc").write_bytes(b"{")
    (repo / "b" / ("manifest-" + "0" * 64 + ".msgpack")).write_bytes(b"partial")
    assert Repository.open(repo).names() == ["a"]
    assert ckptfmt.verify(repo).ok
    assert_same(state, ckptfmt.load(repo))
    ckptfmt.save(state, repo / "b")
    assert_same(state, ckptfmt.load(repo / "b"))
    assert os.path.exists(repo / "b" / layout.COMMIT_NAME)
