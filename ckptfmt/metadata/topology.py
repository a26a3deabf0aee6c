"""Who wrote a checkpoint: world size, each rank's host and device, the backend, meshes and parallelism."""

from __future__ import annotations

import os
import socket

import torch

from ckptfmt._teardown import at_exit


def current_rank() -> tuple[int, int]:
    """(rank, world size) from torch.distributed when initialised, else the launcher's env. A process
    with a process group gets ckptfmt's exit handling (ckptfmt/_teardown.py), loads included."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        at_exit()
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def rank_entry(rank: int) -> dict:
    """This process's entry of ``topology.ranks``: its rank, host, local rank, pid and device."""
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    return {
        "rank": rank,
        "host": socket.gethostname(),
        "local_rank": int(os.environ.get("LOCAL_RANK", 0)),
        "pid": os.getpid(),
        "device": f"cuda:{torch.cuda.current_device()}" if cuda else "cpu",
    }


def topology_record(ranks: list[dict], *, world_size: int, writer_ranks: list[int], parallelism: dict | None,
                    backend: str | None = None, meshes: list[dict] | None = None) -> dict:
    """The manifest's ``topology`` (spec 9.3): the job's size, the ranks that wrote chunks, each
    rank's ``rank_entry``, the process group's ``backend`` and the DTensors' device ``meshes`` where
    known, and the parallelism degrees (dp/tp/pp/...; default ``{"dp": world_size}``)."""
    topology = {"world_size": world_size, "writer_ranks": list(writer_ranks), "ranks": list(ranks)}
    if backend is not None:
        topology["backend"] = backend
    topology["parallelism"] = dict(parallelism) if parallelism else {"dp": world_size}
    if meshes:
        topology["meshes"] = list(meshes)
    return topology
