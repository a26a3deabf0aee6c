"""Crash safety: a save killed at any moment, or failing with an error, never damages the repository."""

from __future__ import annotations

import errno
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import ckptfmt
from ckptfmt import CheckpointNotFoundError, StorageError
from ckptfmt.format import layout
from ckptfmt.repository.repository import Repository
from ckptfmt.storage import local as local_storage
from ckptfmt.storage.factory import open_storage
from ckptfmt.storage.local import LocalStorage
from tests.support.helpers import assert_same, chunk_keys

# Each saved state is 4 x 4 MiB of int32, different at every step, in 1 MiB chunks (16 chunk files
# of one 1 MiB write each): a save takes a measurable moment, so timed kills land inside it.
ELEMENTS = 2**20
CHUNK_SIZE = 2**20

#: A process that imports ckptfmt once and forks one saver per command: starting Python and torch
#: for each kill point would cost seconds. Each saver saves one checkpoint after arming its kill point,
#: prints {"saved_s", "writes"} if the save returns, and ends; the server answers how it ended.
SAVER = textwrap.dedent(
    """
    import json, os, signal, sys, threading, time, traceback
    import torch, ckptfmt
    import ckptfmt.repository.leases as leases
    import ckptfmt.storage.local as storage
    import ckptfmt.metadata.timing as timing
    import ckptfmt.saving.pipeline as pipeline
    from ckptfmt.repository.repository import Repository

    repo, elements, chunk_size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])

    def die():
        os.kill(os.getpid(), signal.SIGKILL)

    def die_on_call(owner, name, call, after=False):
        original, calls = getattr(owner, name), [0]
        def dying(*args, **kwargs):
            calls[0] += 1
            if calls[0] == call and not after:
                die()
            result = original(*args, **kwargs)
            if calls[0] == call and after:
                die()
            return result
        setattr(owner, name, dying)

    def die_entering_phase(name):
        original = timing.PhaseTimer.phase
        def phase(self, entered):
            if entered == name:
                die()
            return original(self, entered)
        timing.PhaseTimer.phase = phase

    def arm(point):
        kind, _, value = point.partition(":")
        if kind == "delay":
            threading.Timer(float(value), die).start()
        elif kind == "phase":
            die_entering_phase(value)
        elif kind == "write":
            die_on_call(storage, "_write_all", int(value))
        elif kind == "before_manifest":
            die_on_call(pipeline, "commit_manifest", 1)
        elif kind in ("before_record", "after_record"):
            die_on_call(Repository, "create_commit", 1, after=kind == "after_record")
        elif kind == "before_lease_release":
            die_on_call(leases.Lease, "release", 1)
        else:
            raise ValueError(point)

    def save(step, point):
        writes, write_all = [0], storage._write_all
        def counted(*args):
            writes[0] += 1
            return write_all(*args)
        storage._write_all = counted
        if point:
            arm(point)
        base = torch.arange(elements, dtype=torch.int32)
        state = {"step": step, **{f"w{k}": base * (k + 1) + step for k in range(4)}}
        started = time.perf_counter()
        ckptfmt.save(state, f"{repo}/step-{step:06d}", step=step, chunk_size=chunk_size)
        print(json.dumps({"saved_s": time.perf_counter() - started, "writes": writes[0]}), flush=True)
        if point and point.startswith("delay:"):
            time.sleep(120)  # a delay longer than this save: the kill is still to come

    for line in sys.stdin:
        command = json.loads(line)
        child = os.fork()
        if child == 0:
            code = 0
            try:
                save(command["step"], command["point"])
            except BaseException:
                print(json.dumps({"error": traceback.format_exc()}), flush=True)
                code = 1
            os._exit(code)  # a forked child: none of the server's exit handlers
        _, status = os.waitpid(child, 0)
        print(json.dumps({"signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
                          "exit": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None}), flush=True)
    """
)

#: Every boundary of a save: entering each phase, then around the manifest, the commit record and the
#: lease's release; and whether the checkpoint killed there exists afterwards.
BOUNDARIES = {"phase:lease": False, "phase:prepare": False, "phase:write_chunks": False, "phase:sync": False,
              "phase:environment": False, "before_manifest": False, "before_record": False,
              "after_record": True, "before_lease_release": True}


def checkpoint_name(step: int) -> str:
    return f"step-{step:06d}"


def expected_state(step: int) -> dict:
    base = torch.arange(ELEMENTS, dtype=torch.int32)
    return {"step": step, **{f"w{k}": base * (k + 1) + step for k in range(4)}}


class Savers:
    """The saver server of ``SAVER`` on ``repo``: ``save(step, point)`` runs one save in a forked saver
    killed at ``point`` (None: not killed) and returns what it reported and how it ended."""

    def __init__(self, repo: Path):
        self.process = subprocess.Popen([sys.executable, "-c", SAVER, str(repo), str(ELEMENTS), str(CHUNK_SIZE)],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def save(self, step: int, point: str | None = None) -> dict:
        self.process.stdin.write(json.dumps({"step": step, "point": point}) + "\n")
        self.process.stdin.flush()
        outcome: dict = {}
        while "signal" not in outcome:
            line = self.process.stdout.readline()
            assert line, f"the saver server ended: exit {self.process.wait()}"
            outcome.update(json.loads(line))
        assert "error" not in outcome, outcome["error"]
        return outcome

    def close(self) -> None:
        self.process.stdin.close()
        try:
            assert self.process.wait(timeout=60) == 0
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()
            self.process.stdout.close()


def check_after_kill(repo: Path, earlier: list[int], step: int) -> bool:
    """Every earlier checkpoint verifies and loads bit-exact; checkpoint ``step``, whose save was killed,
    is absent or complete. Returns whether it is complete."""
    names = Repository.open(repo).names()
    complete = checkpoint_name(step) in names
    assert names == [checkpoint_name(s) for s in earlier] + ([checkpoint_name(step)] if complete else [])
    report = ckptfmt.verify(repo)
    assert report.ok and report.checkpoints == names, report.problems
    for done in earlier + ([step] if complete else []):
        assert_same(expected_state(done), ckptfmt.load(repo / checkpoint_name(done)))
    if not complete:
        with pytest.raises(CheckpointNotFoundError):
            ckptfmt.load(repo / checkpoint_name(step))
        with pytest.raises(CheckpointNotFoundError):
            ckptfmt.open(repo / checkpoint_name(step))
    return complete


def referenced_chunks(repo: Path) -> set[str]:
    repository = Repository.open(repo)
    return {layout.chunk_key(c.hash, c.codec) for n in repository.names() for c in repository.manifest(n).chunks}


def kill_points(measured: dict, timed: int, every_write: bool) -> dict[str, bool | None]:
    """Each kill point, with whether its checkpoint exists afterwards (None: either): every boundary,
    before each write of the ``measured`` save if ``every_write``, and ``timed`` delays spread evenly over
    its time."""
    points = dict(BOUNDARIES)
    if every_write:
        points.update({f"write:{n}": False for n in range(1, measured["writes"] + 1)})
    points.update({f"delay:{(k + 0.5) / timed * measured['saved_s']:.4f}": None for k in range(timed)})
    return points


def kill_saves(repo: Path, timed: int, every_write: bool) -> None:
    """Save twice (the second save measured), then kill a save at each of ``kill_points``, checking the
    repository after each. A save killed at a boundary leaves its name to the next, which meets its
    leftovers; the others save states not stored yet, so that each writes and takes as long as the
    measured one."""
    savers = Savers(repo)
    try:
        savers.save(0)
        measured = savers.save(1)  # into an existing repository, with a parent, as every save below
        earlier, step, unused = [0, 1], 2, 3
        tried = False  # whether a killed save has left checkpoint_name(step) unfinished
        interrupted = 0  # timed kills that landed before the save returned
        for point, exists in kill_points(measured, timed, every_write).items():
            if tried and point not in BOUNDARIES:
                step, unused = unused, unused + 1
            outcome = savers.save(step, point)
            tried = True
            assert outcome["signal"] == signal.SIGKILL, f"{point}: the saver was not killed: {outcome}"
            complete = check_after_kill(repo, earlier, step)
            assert exists is None or complete == exists, point
            assert complete or "saved_s" not in outcome, point  # a save that returned had committed
            if point == "phase:sync":
                assert chunk_keys(str(repo)) - referenced_chunks(repo), "the kill left a save half done"
            interrupted += point.startswith("delay:") and "saved_s" not in outcome
            if complete:
                earlier, step, unused, tried = earlier + [step], unused, unused + 1, False
        assert interrupted, "every timed kill came after its save had returned"
        savers.save(step)  # under the name the last killed save left unfinished, if it did
    finally:
        savers.close()
    assert check_after_kill(repo, earlier, step)
    assert ckptfmt.load(repo)["step"] == step
    shutil.rmtree(repo)  # 16 MiB a checkpoint, and leftovers: not left to pytest's rotation


@pytest.mark.slow
def test_a_save_killed_at_any_moment_leaves_the_repository_intact(tmp_path):
    """Killed (SIGKILL) at each boundary of a save and at three moments spread over its measured time;
    make test-exhaustive also kills it before each of its writes and at 40 moments."""
    kill_saves(tmp_path / "repo", timed=3, every_write=False)


@pytest.mark.exhaustive
@pytest.mark.timeout(1800)
def test_a_save_killed_before_each_write_and_at_many_moments_leaves_the_repository_intact(tmp_path):
    kill_saves(tmp_path / "repo", timed=40, every_write=True)


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

    original_write = local_storage._write_all

    def write_all(fd, data):  # every local write, to a temporary file beside its key
        path = os.readlink(f"/proc/self/fd/{fd}")
        if should_fail(path):
            disk_full(path)
        return original_write(fd, data)

    monkeypatch.setattr(local_storage, "_write_all", write_all)
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
    original = local_storage._write_all

    def flaky(fd, data):
        calls.append(next(writes))
        if calls[-1] == 5:
            raise OSError(errno.EIO, "I/O error")
        return original(fd, data)

    monkeypatch.setattr(local_storage, "_write_all", flaky)
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
