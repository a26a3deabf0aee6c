"""async_save in one process: staged at the call, written in the background, one in flight per repository.

The collective side (4 ranks) is in test_collective_save.py.
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import weakref
from concurrent.futures import Future

import pytest
import torch

import ckptfmt
from ckptfmt.saving import asynchronous
from ckptfmt.saving.options import SaveOptions


def training_state() -> dict:
    torch.manual_seed(0)
    return {"model": {"w": torch.randn(512, 1024), "b": torch.zeros(16)}, "step": 1, "history": [0.5]}


def test_what_is_saved_is_the_state_at_the_call(tmp_path):
    state = training_state()
    expected = {"w": state["model"]["w"].clone(), "b": state["model"]["b"].clone()}
    future = ckptfmt.async_save(state, tmp_path / "repo" / "a", step=1)
    assert isinstance(future, Future)
    state["model"]["w"].add_(1.0)  # the training loop goes on at once
    state["model"]["b"].fill_(7.0)
    state["step"] = 2
    state["history"].append(0.4)
    url = future.result(timeout=60)
    assert future.done() and future.exception() is None
    loaded = ckptfmt.load(url)
    assert torch.equal(loaded["model"]["w"], expected["w"]) and torch.equal(loaded["model"]["b"], expected["b"])
    assert loaded["step"] == 1 and loaded["history"] == [0.5]


def test_the_rng_states_saved_are_those_at_the_call(tmp_path):
    """The loop draws random numbers while the save runs: restore_rng must give the states at the call."""
    import random

    import numpy as np

    future = ckptfmt.async_save(training_state(), tmp_path / "repo" / "a", step=1)
    expected = (torch.rand(4), np.random.rand(4), [random.random() for _ in range(4)])
    for _ in range(1000):  # the loop goes on drawing before the background thread gets far
        torch.rand(4), np.random.rand(4), random.random()
    ckptfmt.restore_rng(future.result(timeout=60))
    got = (torch.rand(4), np.random.rand(4), [random.random() for _ in range(4)])
    assert torch.equal(got[0], expected[0]) and np.array_equal(got[1], expected[1]) and got[2] == expected[2]


def test_staging_buffers_are_allocated_once_and_reused(tmp_path):
    state = training_state()
    for step in range(3):
        ckptfmt.async_save(state, tmp_path / "repo" / f"s{step}", step=step).result(timeout=60)
        buffer = asynchronous.DEFAULT_SAVER.staging_area(tmp_path / "repo" / "x").tensors["model/w"]
        if step == 0:
            address = buffer.data_ptr()
        assert buffer.data_ptr() == address
        state["model"]["w"].mul_(2)
    assert torch.equal(ckptfmt.load(tmp_path / "repo" / "s2")["model"]["w"], state["model"]["w"] / 2)


def test_a_saver_owns_its_staging_buffers_and_close_frees_them(tmp_path):
    """A full host copy of the state stays staged for the next save until its saver is closed."""
    state = training_state()
    state_bytes = sum(t.numel() * t.element_size() for t in state["model"].values())
    saver = asynchronous.AsyncSaver()
    options = SaveOptions(step=1)
    saver.save(state, tmp_path / "repo" / "a", options).result(timeout=60)
    assert saver.held_bytes >= state_bytes
    buffer = weakref.ref(saver.staging_area(tmp_path / "repo" / "a").tensors["model/w"])
    assert buffer() is not None
    saver.close()
    gc.collect()
    assert saver.held_bytes == 0 and buffer() is None
    saver.save(state, tmp_path / "repo" / "b", options.replace(step=2)).result(timeout=60)  # usable again
    assert ckptfmt.load(tmp_path / "repo" / "b")["step"] == state["step"]
    saver.close()


def test_a_manager_closes_its_saver(tmp_path):
    manager = ckptfmt.CheckpointManager(tmp_path / "repo", async_save=True)
    manager.save(1, training_state())
    manager.wait()
    assert manager.saver.held_bytes > 0
    manager.close()
    assert manager.saver.held_bytes == 0


def test_the_next_save_waits_for_the_previous_and_raises_its_error(tmp_path):
    repo = tmp_path / "repo"
    ckptfmt.save({"x": 1}, repo / "taken")
    failing = ckptfmt.async_save(training_state(), repo / "taken")  # fails in the background: the name exists
    with pytest.raises(ckptfmt.CheckpointExistsError):
        ckptfmt.save({"x": 2}, repo / "next")
    assert failing.done() and isinstance(failing.exception(), ckptfmt.CheckpointExistsError)
    assert ckptfmt.save({"x": 2}, repo / "next")  # reported once, then saves go on


def test_saves_to_one_repository_commit_in_call_order(tmp_path):
    repo = tmp_path / "repo"
    ckptfmt.async_save(training_state(), repo / "a", step=1)
    ckptfmt.save({"x": 2}, repo / "b", step=2)  # waits for a: a is b's parent
    assert ckptfmt.open(repo / "b").metadata["parent"] == "a"


def test_wrong_arguments_fail_in_the_caller(tmp_path):
    with pytest.raises(TypeError, match="no_such_option"):
        ckptfmt.async_save({"x": 1}, tmp_path / "repo" / "a", no_such_option=1)


SCRIPT = """
import os, signal, sys, torch, ckptfmt
state = {"w": torch.randn(64, 2**20)}  # 256 MiB: still writing when the process ends
future = ckptfmt.async_save(state, sys.argv[1])
if sys.argv[2] == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.slow
@pytest.mark.parametrize("ending", ["exit", "kill"])
def test_a_pending_save_finishes_at_exit_and_a_killed_one_commits_nothing(tmp_path, ending):
    ckptfmt.save({"w": torch.ones(3)}, tmp_path / "repo" / "before")
    url = tmp_path / "repo" / "pending"
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(SCRIPT), str(url), ending],
                            capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    names = ckptfmt.Repository.open(tmp_path / "repo").names()
    if ending == "exit":
        assert result.returncode == 0, result.stderr
        assert names == ["before", "pending"] and ckptfmt.verify(str(url)).ok
    else:
        assert result.returncode == -signal.SIGKILL
        assert names == ["before"]
    assert ckptfmt.verify(str(tmp_path / "repo")).ok
