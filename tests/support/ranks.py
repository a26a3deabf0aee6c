"""Real multi-process torch.distributed runs for the tests: N spawned ranks on gloo.

``run_ranks(scenario, world, folder, **kwargs)`` starts ``world`` processes, each
joining a gloo process group through a FileStore in ``folder`` (no ports to
pick), runs ``scenario(rank, world, folder, **kwargs)`` (a function of an
importable test module) and returns what each rank returned, or the text of
the exception it raised, as ``RankOutcome``. Ranks are forked from a fork
server that has imported torch and ckptfmt once (``FORKSERVER_PRELOAD``):
importing torch takes ~3 s of CPU here, and a spawned rank paid it every time. Every launch has a timeout: a
hang kills the ranks and fails the one test. Ranks end as a user's do
(``destroy_process_group``, then a normal interpreter exit) and must exit with 0. ``mixed_state`` is the state the
distributed tests save: replicated tensors, DTensors on two meshes, per-rank values.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import random
import signal
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import ckptfmt
from tests.support import markers

#: Imported once by the fork server the ranks are forked from (never run: importing starts no thread).
FORKSERVER_PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint", "ckptfmt", "tests.support.ranks"]
multiprocessing.set_forkserver_preload(FORKSERVER_PRELOAD)


@dataclass
class RankOutcome:
    """What one rank's scenario returned, or the exception it raised (type name, message, traceback)."""

    value: Any = None
    error_type: str | None = None
    error: str | None = None
    trace: str | None = None

    def unwrap(self) -> Any:
        assert self.error_type is None, f"{self.error_type}: {self.error}\n{self.trace}"
        return self.value


def run_ranks(scenario: Callable, world: int, folder: Path, *, timeout: float = 180, killed: tuple[int, ...] = (),
              **kwargs) -> list[RankOutcome | None]:
    """Run ``scenario`` on ``world`` ranks; a rank that died without an outcome gives None.

    Every rank must then have exited with code 0, but those in ``killed``, with SIGKILL."""
    markers.require("distributed")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    context = mp.start_processes(_rank_main, args=(world, str(folder), scenario, kwargs), nprocs=world,
                                 join=False, start_method="forkserver")
    deadline = time.monotonic() + timeout
    for process in context.processes:
        process.join(max(0.0, deadline - time.monotonic()))
    alive = [p for p in context.processes if p.is_alive()]
    for process in alive:
        process.kill()
        process.join()
    assert not alive, f"{len(alive)} rank(s) still running after {timeout} s: killed"
    outcomes = [_outcome(folder, rank) for rank in range(world)]
    # Ranks end the normal way, as a user's do: a crash at exit fails the test.
    codes = [p.exitcode for p in context.processes]
    expected = [-signal.SIGKILL if rank in killed else 0 for rank in range(world)]
    assert codes == expected, f"ranks' exit codes {codes}, expected {expected} (negative: ended by that signal)"
    return outcomes


def _outcome(folder: Path, rank: int) -> RankOutcome | None:
    path = folder / f"outcome-{rank}.pkl"
    return pickle.loads(path.read_bytes()) if path.exists() else None


def _rank_main(rank: int, world: int, folder: str, scenario: Callable, kwargs: dict) -> None:
    os.environ.update(OMP_NUM_THREADS="1", RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    # gloo connects the ranks pairwise during init; a rank whose scenario returns at once and exits
    # can close its side before a slower peer has finished connecting, failing that peer's init.
    dist.barrier()
    try:
        outcome = RankOutcome(value=scenario(rank, world, Path(folder), **kwargs))
    except Exception as exc:
        outcome = RankOutcome(error_type=type(exc).__name__, error=str(exc), trace=traceback.format_exc())
    Path(folder, f"outcome-{rank}.pkl").write_bytes(pickle.dumps(outcome))
    dist.destroy_process_group()


def mixed_state(rank: int, world: int) -> tuple[dict, dict]:
    """Replicated tensors, DTensors on 1-D and 2-D meshes (uneven, replicated on one dim), per-rank and
    differing values. Returns the state and the full tensors the DTensors were cut from."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    torch.manual_seed(0)  # every rank builds the same full tensors
    full = {"row": torch.randn(10, 3), "grid": torch.randn(6, 8), "half": torch.randn(7, 5)}
    layers = [torch.randn(64, 1024) for _ in range(8)]
    flat = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    grid = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    state = {
        "model": {
            "layers": layers,
            "bias": torch.arange(10.0),
            "row": distribute_tensor(full["row"], flat, [Shard(0)]),
            "grid": distribute_tensor(full["grid"], grid, [Shard(0), Shard(1)]),
            "half": distribute_tensor(full["half"], grid, [Replicate(), Shard(0)]),
        },
        "step": 7,
        "loader": ckptfmt.PerRank({"position": 100 * rank}),
        "seen_by": f"rank-{rank}",  # differs by mistake: reported, rank 0's kept
    }
    return state, {**full, "layers": layers, "bias": torch.arange(10.0)}


def save_mixed_state(rank: int, world: int, folder: Path, repo: str) -> dict:
    state, full = mixed_state(rank, world)
    random.seed(rank)  # each rank's own Python RNG stream
    timer = ckptfmt.StepTimer()
    for step in range(rank + 1):  # each rank its own number of steps and its own samples
        with timer.step(step):
            timer.batch([world * step + rank])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        url = ckptfmt.save(state, f"{repo}/step-7", step=7, parallelism={"dp": 2, "tp": 2}, timeout=60,
                           timer=timer)
    return {"url": url, "full": full, "warnings": [str(w.message) for w in caught], "next_random": random.random()}
