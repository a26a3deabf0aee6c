"""CheckpointManager: retention after each save, tiers, restore, interval="auto", collective use."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import pytest
import torch

import ckptfmt
from ckptfmt import CheckpointManager, Retention, Tier
from ckptfmt.format import layout
from ckptfmt.lifecycle.housekeeping import Housekeeper
from ckptfmt.lifecycle.housekeeping_process import CHILD_NICE, HousekeepingProcess
from ckptfmt.lifecycle.housekeeping_process import SUPPORTED as PROCESS_SUPPORTED
from ckptfmt.repository.repository import Repository
from tests.support.ranks import run_ranks


def model_state(step: int) -> dict:
    """256 KiB tensors (one chunk each): 'frozen' never changes, 'w' changes every step."""
    return {"frozen": torch.arange(65536, dtype=torch.float32), "w": torch.full((65536,), float(step)),
            "step": step}


def stored_chunks(url: str, options: dict | None = None) -> set[str]:
    repo = Repository.open(url, options)
    return {k for k in repo.storage.find(layout.CHUNKS_DIR) if not k.rsplit("/", 1)[-1].startswith(".")}


def referenced_chunks(url: str, options: dict | None = None) -> set[str]:
    repo = Repository.open(url, options)
    return {layout.chunk_key(c.hash, c.codec) for n in repo.names() for c in repo.manifest(n).chunks}


@pytest.mark.parametrize("async_save", [False, True])
def test_keep_last_deletes_old_checkpoints_and_their_chunks(tmp_path, async_save):
    url = str(tmp_path / "run")
    with CheckpointManager(url, keep_last=2, async_save=async_save) as manager:
        for step in range(8):
            assert manager.save(step, model_state(step))
        manager.wait()
        assert manager.steps() == [6, 7] and manager.latest() == 7
        restored = manager.restore()
    assert restored["step"] == 7 and torch.equal(restored["w"], torch.full((65536,), 7.0))
    assert ckptfmt.verify(url).ok
    assert stored_chunks(url) == referenced_chunks(url)  # 'frozen' once, and the two kept 'w's


def test_keep_every_and_keep_best_combine(tmp_path):
    url = str(tmp_path / "run")
    losses = {0: 5.0, 1: 4.0, 2: 1.0, 3: 3.0, 4: 2.5, 5: None, 6: 2.0, 7: 4.5, 8: 6.0}
    with CheckpointManager(url, keep_every=4, keep_best=("val_loss", "min", 2)) as manager:
        for step, loss in losses.items():
            manager.save(step, model_state(step), metrics=None if loss is None else {"val_loss": loss})
    # multiples of 4; the two best (2: 1.0, 6: 2.0); 5 has no metric; 8 is the newest
    assert CheckpointManager(url).steps() == [0, 2, 4, 5, 6, 8]
    restored = CheckpointManager(url).restore(step=2)
    assert restored["step"] == 2


def test_interval_saves_only_when_due(tmp_path):
    url = str(tmp_path / "run")
    with CheckpointManager(url, interval=3) as manager:
        saved = [step for step in range(1, 10) if manager.save(step, model_state(step))]
        assert manager.save(10, model_state(10), force=True)
    assert saved == [3, 6, 9]
    assert CheckpointManager(url).steps() == [3, 6, 9, 10]


def test_restore_into_a_state_in_place(tmp_path):
    url = str(tmp_path / "run")
    with CheckpointManager(url) as manager:
        manager.save(5, model_state(5))
        target = model_state(0)
        assert manager.restore(into=target) is target
    assert torch.equal(target["w"], torch.full((65536,), 5.0)) and target["step"] == 5


def test_housekeeping_stays_off_the_training_loop(tmp_path, monkeypatch):
    """A slow retention pass does not hold save() up: it runs on the manager's thread, and the next
    save returns while that pass is still deleting."""
    from ckptfmt.lifecycle import housekeeping
    real_remove = housekeeping.remove
    deleting, release = threading.Event(), threading.Event()
    passes = []  # (thread, whether it was released rather than timed out) of each retention pass

    def held_remove(repo, names):  # held until the test releases it (on the loop it would deadlock: not held)
        deleting.set()
        on_loop = threading.current_thread() is threading.main_thread()
        passes.append((threading.current_thread(), on_loop or release.wait(60)))
        return real_remove(repo, names)
    monkeypatch.setattr(housekeeping, "remove", held_remove)
    url = str(tmp_path / "run")
    with CheckpointManager(url, keep_last=1) as manager:
        manager.save(0, model_state(0))
        manager.save(1, model_state(1))  # its pass deletes step 0, and is held there
        assert deleting.wait(60)
        manager.save(2, model_state(2))  # returns while that pass is held
        release.set()
        manager.wait()
        assert manager.steps() == [2]
    assert passes and all(thread is not threading.main_thread() and released for thread, released in passes)


def proc_stat(pid: int) -> list[str]:
    """The fields of /proc/PID/stat after the command's name: [0] the state (field 3), [16] nice (19)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def nice_of(pid: int) -> int:
    return int(proc_stat(pid)[16])


def running(pid: int) -> bool:
    """Whether the process exists and has not died (a zombie waits only to be reaped)."""
    try:
        return proc_stat(pid)[0] != "Z"
    except FileNotFoundError:
        return False


#: The child process that copies to the next tiers is Linux's (the kernel ends it with its parent).
process_mode = pytest.mark.skipif(not PROCESS_SUPPORTED, reason="housekeeping in a child process needs Linux")


@process_mode
def test_replication_runs_in_a_child_process_at_the_lowest_priority(tmp_path):
    """Copies to the next tier take neither the loop's GIL nor its CPU priority; the child goes with the
    manager."""
    fast, slow = str(tmp_path / "fast"), str(tmp_path / "slow")
    loop_nice = nice_of(os.getpid())
    with CheckpointManager(tiers=[fast, slow]) as manager:
        manager.save(1, model_state(1))
        manager.wait()
        child = manager.housekeeper.pid
        assert child is not None and child != os.getpid()
        assert nice_of(child) == CHILD_NICE
        assert CheckpointManager(slow).steps() == [1]
    assert nice_of(os.getpid()) == loop_nice
    assert not Path(f"/proc/{child}").exists()  # ended, and reaped by close()


@pytest.mark.slow
@process_mode
def test_a_killed_housekeeping_process_is_replaced_and_catches_up(tmp_path):
    fast, slow = str(tmp_path / "fast"), str(tmp_path / "slow")
    with CheckpointManager(tiers=[fast, slow]) as manager:
        manager.save(1, model_state(1))
        manager.wait()
        os.kill(manager.housekeeper.pid, signal.SIGKILL)
        with pytest.warns(ckptfmt.CheckpointWarning, match="replication process ended"):
            manager.save(2, model_state(2))
            manager.wait()
        manager.save(3, model_state(3))
        manager.wait()
        assert CheckpointManager(slow).steps() == [1, 2, 3]
    assert ckptfmt.verify(slow).ok


@process_mode
@pytest.mark.filterwarnings("ignore:skipping checkpoint 'junk'")  # the same, met by retention in this process
def test_warnings_in_the_child_are_raised_in_the_training_process(tmp_path):
    fast, slow = tmp_path / "fast", tmp_path / "slow"
    with CheckpointManager(tiers=[str(fast), str(slow)]) as manager:
        manager.save(1, model_state(1))
        manager.wait()
        (fast / "junk").mkdir()
        (fast / "junk" / "COMMIT").write_bytes(b"\xff not a commit record")
        with pytest.warns(ckptfmt.CheckpointWarning,
                          match=r"replication process: skipping checkpoint 'junk'"):
            manager.save(2, model_state(2))
            manager.wait()
        assert CheckpointManager(str(slow)).steps() == [1, 2]


TRAINER_KILLED_WHILE_SAVING = """
import os, sys, time, torch, ckptfmt
manager = ckptfmt.CheckpointManager(tiers=[sys.argv[1], sys.argv[2]])
manager.save(1, {"w": torch.zeros(1000)})
manager.wait()
manager.housekeeper.pause()  # as at the start of a save: the child is stopped
print(manager.housekeeper.pid, flush=True)
time.sleep(600)
"""


@process_mode
def test_the_child_ends_with_a_training_process_killed_while_it_was_stopped(tmp_path):
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER_KILLED_WHILE_SAVING, str(tmp_path / "fast"),
                                str(tmp_path / "slow")], stdout=subprocess.PIPE, text=True)
    try:
        child = int(trainer.stdout.readline())
        deadline = time.monotonic() + 10
        while proc_stat(child)[0] != "T":  # SIGSTOP takes effect when the kernel next schedules the child
            assert time.monotonic() < deadline, f"the child was not stopped: state {proc_stat(child)[0]}"
            time.sleep(0.01)
    finally:
        trainer.kill()
        trainer.wait()
    deadline = time.monotonic() + 10
    while running(child):
        assert time.monotonic() < deadline, "the replication process outlived the training process"
        time.sleep(0.05)


TRAINER_KILLED_AS_THE_CHILD_STARTS = """
import sys, threading, time, torch, ckptfmt
manager = ckptfmt.CheckpointManager(tiers=[sys.argv[1], sys.argv[2]])
manager.housekeeper.pause()  # a save runs as the first copy starts the child
threading.Thread(target=manager.housekeeper.replicate, args=({},), daemon=True).start()
while manager.housekeeper.pid is None:
    time.sleep(0.001)
print(manager.housekeeper.pid, flush=True)  # the child is still starting up: the test kills this process
time.sleep(600)
"""


@process_mode
def test_the_child_ends_with_a_training_process_killed_while_the_child_started(tmp_path):
    """A child stopped before it had asked the kernel to kill it with its parent outlived the training
    process, stopped for good and holding its stdout and stderr open (a kill in the README's loop hung
    its test): the child is stopped only once it says it is armed."""
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER_KILLED_AS_THE_CHILD_STARTS, str(tmp_path / "fast"),
                                str(tmp_path / "slow")], stdout=subprocess.PIPE, text=True)
    try:
        child = int(trainer.stdout.readline())
    finally:
        trainer.kill()
        trainer.wait()
    deadline = time.monotonic() + 10
    try:
        while running(child):
            assert time.monotonic() < deadline, f"the replication process outlived the training process " \
                                                f"(state {proc_stat(child)[0]})"
            time.sleep(0.05)
    finally:
        if running(child):
            os.kill(child, signal.SIGKILL)


def test_wait_after_an_async_save_waits_for_its_copy_to_the_next_tier(tmp_path, monkeypatch):
    """wait() returns only once the housekeeping after the last save is done, even when the save's
    completion callbacks run late (they run on the save's thread, after its future is done)."""
    fast, slow = str(tmp_path / "fast"), str(tmp_path / "slow")
    with CheckpointManager(tiers=[fast, slow], async_save=True, housekeeping="thread") as manager:
        real = manager.saver.save

        def late_callbacks(*args, **kwargs):
            future = real(*args, **kwargs)
            add = future.add_done_callback
            future.add_done_callback = lambda callback: add(lambda done: (time.sleep(0.5), callback(done)))
            return future
        monkeypatch.setattr(manager.saver, "save", late_callbacks)
        manager.save(1, model_state(1))
        manager.wait()
        assert CheckpointManager(slow).steps() == [1]


@process_mode
def test_closing_ends_the_child_though_a_forked_process_holds_the_connection(tmp_path):
    """A DataLoader worker forked from the training process keeps a copy of the manager's socket: the
    child is told to stop rather than left waiting for the connection to close."""
    fast, slow = str(tmp_path / "fast"), str(tmp_path / "slow")
    manager = CheckpointManager(tiers=[fast, slow])
    manager.save(1, model_state(1))
    manager.wait()
    child = manager.housekeeper.pid
    statuses, stop = [], manager.housekeeper._stop  # the child's exit status, as close() reaps it
    manager.housekeeper._stop = lambda: statuses.append(stop())
    worker = os.fork()
    if worker == 0:  # the "DataLoader worker": holds every descriptor of the training process until killed
        time.sleep(600)
        os._exit(0)
    try:
        manager.close()
        # 0: it read "stop" and ended; waiting for the connection to close, it would have been killed
        # after CLOSE_TIMEOUT_S (-SIGKILL)
        assert statuses == [0] and not running(child)
    finally:
        os.kill(worker, signal.SIGKILL)
        os.waitpid(worker, 0)


@pytest.mark.slow
@pytest.mark.parametrize("keeper_class", [Housekeeper, pytest.param(HousekeepingProcess, marks=process_mode)])
def test_copying_to_the_next_tier_waits_while_paused(tmp_path, keeper_class):
    fast, slow = Tier(str(tmp_path / "fast"), Retention()), Tier(str(tmp_path / "slow"), Retention())
    keeper = keeper_class([fast, slow], 0.0)
    try:
        ckptfmt.save(model_state(0), f"{fast.url}/step-0", step=0)
        assert keeper.run({}) == []  # the child, if any, is up, and step 0 copied
        copied = stored_chunks(slow.url)
        ckptfmt.save(model_state(1), f"{fast.url}/step-1", step=1)
        keeper.pause()  # as the manager does while the loop saves
        with ThreadPoolExecutor(1) as pool:
            run = pool.submit(keeper.run, {})
            time.sleep(1.5)
            assert not run.done() and stored_chunks(slow.url) == copied
            keeper.resume()
            assert run.result(timeout=60) == []
        assert CheckpointManager(slow.url).steps() == [0, 1]
    finally:
        keeper.close()


def test_tiers_in_process_memory_keep_house_on_a_thread():
    tiers = [f"memory://{uuid.uuid4().hex}/fast", f"memory://{uuid.uuid4().hex}/slow"]
    with pytest.raises(ValueError, match="this process's memory"):
        CheckpointManager(tiers=tiers, housekeeping="process")
    with CheckpointManager(tiers=tiers, keep_last=1) as manager:
        assert isinstance(manager.housekeeper, Housekeeper)
        for step in range(3):
            manager.save(step, model_state(step))
        manager.wait()
        assert CheckpointManager(tiers[0]).steps() == [2] and CheckpointManager(tiers[1]).steps() == [2]


def test_tiers_local_then_s3_each_with_its_retention(tmp_path, s3_bucket):
    local, remote = str(tmp_path / "nvme"), f"{s3_bucket}/run"
    tiers = [local, Tier(remote, Retention(keep_every=4))]
    with CheckpointManager(tiers=tiers, keep_last=2, async_save=True) as manager:
        for step in range(10):
            manager.save(step, model_state(step))
        manager.wait()
        assert CheckpointManager(local).steps() == [8, 9]
        assert CheckpointManager(remote).steps() == [0, 4, 8]  # only what S3 keeps was uploaded
        assert manager.steps() == [0, 4, 8, 9] and manager.restore()["step"] == 9
    assert ckptfmt.verify(remote).ok
    assert stored_chunks(remote) == referenced_chunks(remote)
    assert stored_chunks(local) == referenced_chunks(local)

    # the local disk is lost: restore falls back to S3's newest
    for name in Repository.open(local).names():
        ckptfmt.lifecycle.gc.remove(Repository.open(local), [name])
    manager = CheckpointManager(tiers=tiers, keep_last=2)
    assert manager.latest() == 8 and torch.equal(manager.restore()["w"], torch.full((65536,), 8.0))


def test_restore_reads_the_next_tier_when_the_fast_copy_is_damaged(tmp_path):
    fast, slow = str(tmp_path / "fast"), str(tmp_path / "slow")
    with CheckpointManager(tiers=[fast, slow]) as manager:
        manager.save(1, model_state(1))
    repo = Repository.open(fast)
    key = next(k for k in repo.storage.find(layout.CHUNKS_DIR))
    path = Path(fast) / key
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.warns(ckptfmt.CheckpointWarning, match=f"read from {slow}/{key} instead, and repairing this copy"):
        restored = CheckpointManager(tiers=[fast, slow]).restore(mmap=False)
    assert restored["step"] == 1 and torch.equal(restored["frozen"], torch.arange(65536, dtype=torch.float32))
    assert ckptfmt.verify(fast).ok  # the chunk alone came from the next tier, and was repaired


@pytest.mark.slow
def test_auto_interval_follows_the_measured_stall_and_mtbf(tmp_path):
    """Steps of 20 ms and a save stall of some ms: with an MTBF of 2 s Daly's interval is a few dozen
    steps at most, so the run saves several times; with 1 h it is hundreds, so only the first save
    (which measures the stall) happens in 60 steps."""
    saved, planned = {}, {}
    for mtbf in (timedelta(seconds=2), timedelta(hours=1)):
        with CheckpointManager(str(tmp_path / f"run-{mtbf.seconds}"), interval="auto", mtbf=mtbf) as manager:
            saved[mtbf] = [step for step in range(60)
                           if time.sleep(0.02) or manager.save(step, {"w": torch.randn(2**20), "step": step})]
            planned[mtbf] = manager.planned_interval
    short, long = timedelta(seconds=2), timedelta(hours=1)
    assert saved[long] == [0] and planned[long] > 60
    assert len(saved[short]) >= 2 and saved[short][0] == 0 and 1 <= planned[short] < planned[long]
    assert all(b - a >= min(planned[short], 5) for a, b in zip(saved[short], saved[short][1:]))


def manager_ranks(rank: int, world: int, folder: str, url: str) -> list[int]:
    with CheckpointManager(url, keep_last=2, interval=2) as manager:
        for step in range(1, 9):
            manager.save(step, {"w": torch.full((65536,), float(step)), "rank": ckptfmt.PerRank(rank)})
        manager.wait()
        return manager.steps()


@pytest.mark.distributed
def test_collective_manager_keeps_the_last_two(tmp_path):
    url = str(tmp_path / "run")
    outcomes = [o.unwrap() for o in run_ranks(manager_ranks, 2, tmp_path / "pg", url=url)]
    assert CheckpointManager(url).steps() == [6, 8]
    assert all(steps[-1] == 8 for steps in outcomes)
    assert ckptfmt.verify(url).ok
    assert stored_chunks(url) == referenced_chunks(url)
