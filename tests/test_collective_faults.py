"""A rank killed (SIGKILL) during a collective save, sync or async, the coordinator in its commit included.

Each case: 4 gloo ranks save ``base`` together, then ``next`` while one rank is
killed, after a random delay or at a chosen step of the coordinator's commit.
Afterwards ``base`` verifies, ``next`` is either absent or complete (a kill
after the commit record), and every surviving rank raised a CollectiveError
within the save's timeout unless the save had committed.

32 kill points run in ``make test-exhaustive`` (and .ci/run); ``make test`` runs 4 of them.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

import ckptfmt
from ckptfmt import writer
from ckptfmt.repository import Repository

from ranks import run_ranks

WORLD = 4
TIMEOUT_S = 15


def _kill_me() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _arm(point: str) -> None:
    """Make this rank die at ``point``: 'delay:S' seconds from now, or a step of the coordinator's commit."""
    kind, _, value = point.partition(":")
    if kind == "delay":
        threading.Timer(float(value), _kill_me).start()
    elif value == "before_manifest":
        writer.commit_manifest = lambda repo, manifest: _kill_me()
    elif value == "before_record":
        Repository.create_commit = lambda self, record: _kill_me()
    elif value == "after_record":
        create = Repository.create_commit

        def create_then_die(self, record):
            create(self, record)
            _kill_me()
        Repository.create_commit = create_then_die


def save_while_one_dies(rank: int, world: int, folder: Path, repo: str, mode: str, victim: int, point: str) -> dict:
    ckptfmt.save({"w": torch.full((1000,), float(rank)), "step": 1}, f"{repo}/base", timeout=TIMEOUT_S)
    torch.manual_seed(rank)
    state = {"layers": [torch.randn(2**20) for _ in range(6)], "step": 2}  # 24 MiB per rank
    if rank == victim:
        _arm(point)
    start = time.monotonic()
    try:
        if mode == "async":
            ckptfmt.async_save(state, f"{repo}/next", timeout=TIMEOUT_S).result(timeout=120)
        else:
            ckptfmt.save(state, f"{repo}/next", timeout=TIMEOUT_S)
        outcome = "committed"
    except ckptfmt.CollectiveError as exc:
        outcome = f"raised: {exc}"
    if rank == victim:
        time.sleep(30)  # the kill is still to come: never report
    return {"outcome": outcome, "seconds": time.monotonic() - start}


def kill_points(count: int, seed: int = 0) -> list[tuple[str, int, str]]:
    """(mode, victim rank, point): random delays over the save's span, and every step of the commit."""
    rng = random.Random(seed)
    points = [(mode, 0, f"commit:{step}") for mode in ("sync", "async")
              for step in ("before_manifest", "before_record", "after_record")]
    while len(points) < count:
        points.append((rng.choice(["sync", "async"]), rng.randrange(WORLD), f"delay:{rng.uniform(0.0, 1.2):.3f}"))
    return points


ALL = kill_points(32)
QUICK = {ALL[0], ALL[4], ALL[6], ALL[7]}  # sync before the manifest, async before the record, two delays


@pytest.mark.parametrize(("mode", "victim", "point"), [
    pytest.param(*case, marks=() if case in QUICK else pytest.mark.exhaustive) for case in ALL
])
def test_a_killed_rank_never_leaves_a_partial_checkpoint(tmp_path, mode, victim, point):
    repo = tmp_path / "repo"
    outcomes = run_ranks(save_while_one_dies, WORLD, tmp_path / "run", timeout=150, repo=str(repo), mode=mode,
                         victim=victim, point=point)
    assert outcomes[victim] is None  # killed
    assert ckptfmt.verify(str(repo / "base")).ok
    committed = "next" in Repository.open(repo).names()
    if committed:
        assert ckptfmt.verify(str(repo / "next")).ok
    survivors = [o.unwrap() for r, o in enumerate(outcomes) if r != victim]
    for survivor in survivors:
        assert survivor["seconds"] < TIMEOUT_S + 15, survivor
        if not committed:
            assert survivor["outcome"].startswith("raised: "), survivor
    if point.startswith("commit:before"):
        assert not committed
    if point == "commit:after_record":
        assert committed
