"""Who wrote a checkpoint: world size, this process's rank and host, the parallelism layout."""

from __future__ import annotations

import os
import socket

import torch


def current_rank() -> tuple[int, int]:
    """(rank, world size) from torch.distributed when initialised, else the launcher's env."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
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


def capture_topology(parallelism: dict | None = None) -> dict:
    """The topology record of a single-process save: its rank, and the parallelism degrees (dp/tp/pp/...)."""
    rank, world_size = current_rank()
    return {
        "world_size": world_size,
        "writer_ranks": [rank],
        "ranks": [rank_entry(rank)],
        "parallelism": dict(parallelism) if parallelism else {"dp": world_size},
    }
