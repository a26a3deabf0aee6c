"""The ranks of a torch.distributed process group as a save's group, each collective bounded by a timeout.

Metadata travels by torch's object collectives (gather to the coordinator,
broadcast from it) on a gloo group of the same ranks made for ckptfmt: it
works whatever the training group's backend (object collectives on NCCL need
a GPU each), and its timeout is the save's own, not the training group's
(30 minutes by default). Tensor bytes never pass through it.

A collective that fails (a rank died, raised before reaching it, or never
called save) becomes a ``CollectiveError`` on every rank that can still run.

The gloo groups are made once and reused, and let go of before the
interpreter shuts down (ckptfmt/_teardown.py): a group still alive then is
destroyed during finalisation, when its worker threads may still hold the last
collective's tensors, and a thread that needs the interpreter to free them
then aborts the process ("terminate called without an active exception").
"""

from __future__ import annotations

import weakref
from datetime import timedelta
from typing import Any

import torch

from ckptfmt._teardown import at_exit, settle
from ckptfmt.errors import CheckpointError, CollectiveError
from ckptfmt.metadata.topology import rank_entry

#: Every side group made and not yet freed (tests check that a failed save's is freed at exit).
_MADE: weakref.WeakSet = weakref.WeakSet()
#: gloo groups made for saves: (the training group, its ranks, timeout) -> group.
_SIDE_GROUPS: dict[tuple, Any] = {}


def distributed_group(process_group) -> Any | None:
    """The group a save is collective over: ``process_group``, else the default one if initialised and
    larger than one process, else None (the process saves alone)."""
    dist = torch.distributed
    if process_group is not None:
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("process_group was given but torch.distributed is not initialised")
        return process_group
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.group.WORLD
    return None


class RankGroup:
    """This process's view of the ranks of ``group`` saving together (``groups.ranks.Ranks``): its rank
    in the group (its position too), the coordinator (rank 0), the collectives."""

    collective = True

    def __init__(self, group, timeout_s: float, what: str):
        dist = torch.distributed
        self.what = what
        self.group = group
        self.rank = self.position = dist.get_rank(group)
        self.size = self.count = dist.get_world_size(group)
        self.global_ranks = dist.get_process_group_ranks(group)
        self.timeout_s = float(timeout_s)
        self.backend = str(dist.get_backend(group))
        self.side = self._call("set up", lambda: _side_group(group, self.global_ranks, self.timeout_s))

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    def rank_of(self, position: int) -> int:
        return position

    def topology_entry(self) -> dict:
        """This rank's entry, by its rank in the group, with its rank in the job (``global_rank``)."""
        return {**rank_entry(self.rank), "global_rank": self.global_ranks[self.rank]}

    def join(self) -> None:
        """Wait until every rank has called in; the coordinator learns which ranks did not."""
        self._call("wait for every rank to join", lambda: torch.distributed.monitored_barrier(
            self.side, timeout=timedelta(seconds=self.timeout_s), wait_all_ranks=True))

    def gather(self, value: Any) -> list[Any] | None:
        """Every rank's ``value`` on the coordinator (in rank order), None elsewhere."""
        out = [None] * self.size if self.is_coordinator else None
        self._call("gather", lambda: torch.distributed.gather_object(value, out, group=self.side, group_dst=0))
        return out

    def broadcast(self, value: Any = None) -> Any:
        """The coordinator's ``value`` on every rank."""
        box = [value]
        self._call("broadcast", lambda: torch.distributed.broadcast_object_list(box, group=self.side, group_src=0))
        return box[0]

    def _call(self, step: str, run):
        try:
            return run()
        except CheckpointError:
            raise
        except (RuntimeError, ValueError) as exc:  # DistBackendError, gloo timeouts, closed connections
            detail = " ".join(str(exc).split())[:400]
            raise CollectiveError(
                f"{self.what}: rank {self.rank} of {self.size} could not {step} within {self.timeout_s:g} s "
                f"(a rank failed, was killed, or did not call it): {detail}"
            ) from None


def peer_group(global_ranks: list[int], timeout_s: float, purpose: str):
    """A gloo group of ``global_ranks`` (only they call this) for ``purpose``, apart from the saves' own
    (its traffic never queues behind theirs), made once and freed at exit as theirs are."""
    return _side_group(purpose, global_ranks, timeout_s)


def _side_group(group, global_ranks: list[int], timeout_s: float):
    """A gloo group over the same ranks, made once per group and timeout (again after
    ``destroy_process_group``)."""
    dist = torch.distributed
    _forget_destroyed()
    key = (id(dist.group.WORLD), group if isinstance(group, str) else id(group), tuple(global_ranks), timeout_s)
    side = _SIDE_GROUPS.get(key)
    if side is None:
        side = dist.new_group(ranks=global_ranks, timeout=timedelta(seconds=timeout_s), backend="gloo",
                              use_local_synchronization=True)
        _SIDE_GROUPS[key] = side
        _MADE.add(side)
    return side


def _forget_destroyed() -> None:
    """Let go of the groups that ``destroy_process_group`` has destroyed since."""
    registered = torch.distributed.distributed_c10d._world.pg_map
    for key in [key for key, side in _SIDE_GROUPS.items() if side not in registered]:
        del _SIDE_GROUPS[key]


def release_side_groups() -> None:
    """Destroy this process's side groups (locally: no collective) and settle (``_teardown.settle``), as at
    exit (ckptfmt/_teardown.py says why)."""
    _destroy_side_groups()
    settle()


def _destroy_side_groups() -> None:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        _forget_destroyed()
        for side in _SIDE_GROUPS.values():
            dist.destroy_process_group(side)
    _SIDE_GROUPS.clear()


at_exit(_destroy_side_groups)
