"""A data position that survives a new world size: ``ResumableSampler``, for map-style datasets.

    sampler = ResumableSampler(dataset, batch_size=8)          # this rank's share of each global batch
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler)
    ...
    state = {"model": ..., "sampler": sampler.state_dict()}    # saved with the checkpoint
    ...
    sampler.load_state_dict(ckptfmt.load(url)["sampler"])     # at any world size

Each epoch has one global order of the dataset's indices (a permutation drawn
from ``seed`` and the epoch, or the identity), cut into global batches of
``batch_size * num_replicas`` samples; rank r takes the r-th slice of each.
The position is the number of samples of the epoch's order the whole job has
consumed, not a rank's count, so a resume on another number of ranks takes the
next global batch from the same place: no sample is repeated and none skipped,
whatever the world size (with the same global batch, each step's samples are
even the same). Call ``set_epoch`` at each epoch's start, as
``DistributedSampler`` asks. The state also records the sampler's contract
(seed, shuffle, the dataset's length and a fingerprint of it, the world and
batch sizes, the loader's workers): a resume that changed the seed, the shuffling or the dataset
is refused with the field named, as its order would not be the one consumed.

The position counts the batches this sampler handed out. A ``DataLoader`` with
``num_workers=0`` takes them as the loop does; with workers it fetches ahead, so
pass the batches the loop consumed in this epoch: ``state_dict(batches=n)``.
Each epoch drops the samples that do not fill a last global batch.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

import blake3
import numpy as np
import torch

from ckptfmt.errors import CheckpointError

#: The contract's fields a resume must keep: another value would not continue the order consumed.
KEPT = ("seed", "shuffle", "dataset_length", "dataset_fingerprint")
#: Items of the dataset the fingerprint reads (first, last and evenly between).
FINGERPRINT_ITEMS = 16


class ResumableSampler(torch.utils.data.Sampler):
    """This rank's batches of each epoch's global order, from a position saved at any world size."""

    def __init__(self, dataset: Sized, batch_size: int, *, num_replicas: int | None = None, rank: int | None = None,
                 seed: int = 0, shuffle: bool = True, workers: int = 0):
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, not {batch_size}")
        dist = torch.distributed
        joined = dist.is_available() and dist.is_initialized()
        self.num_replicas = num_replicas if num_replicas is not None else dist.get_world_size() if joined else 1
        self.rank = rank if rank is not None else dist.get_rank() if joined else 0
        if not 0 <= self.rank < self.num_replicas:
            raise ValueError(f"rank {self.rank} is not one of {self.num_replicas} replicas")
        self.dataset_length = len(dataset)
        self.dataset_fingerprint = fingerprint(dataset)
        self.batch_size, self.seed, self.shuffle, self.workers = batch_size, seed, shuffle, workers
        self.epoch = 0
        #: Samples of this epoch's order consumed by the job before this sampler's iteration began.
        self.start = 0
        #: Batches this rank's iteration has handed out since.
        self.handed = 0

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.num_replicas

    def __len__(self) -> int:
        """This rank's batches left in the epoch."""
        return max(self.dataset_length - self.start, 0) // self.global_batch

    def __iter__(self) -> Iterator[list[int]]:
        order = self.order(self.epoch)
        start, width = self.start, self.global_batch
        self.handed = 0
        for batch in range(len(self)):
            first = start + batch * width + self.rank * self.batch_size
            self.handed = batch + 1
            yield order[first:first + self.batch_size].tolist()

    def order(self, epoch: int) -> np.ndarray:
        """The epoch's global order of the dataset's indices."""
        if not self.shuffle:
            return np.arange(self.dataset_length)
        generator = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.dataset_length, generator=generator).numpy()

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from its beginning (a resumed epoch keeps its position)."""
        if epoch != self.epoch:
            self.epoch, self.start, self.handed = epoch, 0, 0

    def consumed(self, batches: int | None = None) -> int:
        """Samples of the epoch's order the job has consumed: before this iteration, and ``batches`` global
        batches since (default: the batches handed out)."""
        return self.start + (self.handed if batches is None else batches) * self.global_batch

    def state_dict(self, batches: int | None = None) -> dict[str, Any]:
        """The position and the contract (plain values, the same on every rank: saved with the checkpoint,
        whose topology records the ranks). ``batches``: the batches the loop consumed in this iteration,
        where a loader with workers fetched ahead."""
        return {"epoch": self.epoch, "consumed": self.consumed(batches), "seed": self.seed, "shuffle": self.shuffle,
                "dataset_length": self.dataset_length, "dataset_fingerprint": self.dataset_fingerprint,
                "num_replicas": self.num_replicas, "batch_size": self.batch_size, "workers": self.workers}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position, at this sampler's world and batch sizes; refuses a state whose
        order is not this sampler's (its seed, shuffling or dataset changed), naming the field."""
        if not isinstance(state, dict) or type(state.get("consumed")) is not int or type(state.get("epoch")) is not int:
            raise CheckpointError(f"not a ResumableSampler state: {state!r:.200}")
        mine = self.state_dict()
        changed = [name for name in KEPT if state.get(name) != mine[name]]
        if changed:
            raise CheckpointError("the data position cannot be resumed: " + ", ".join(
                f"{name} was {state.get(name)!r}, is {mine[name]!r}" for name in changed)
                + " (the samples consumed were of another order)")
        if not 0 <= state["consumed"] <= self.dataset_length:
            raise CheckpointError(f"the data position {state['consumed']} is outside the dataset of "
                                  f"{self.dataset_length} samples")
        self.epoch, self.start, self.handed = state["epoch"], state["consumed"], 0


def fingerprint(dataset: Sized) -> str:
    """32 hex digits of BLAKE3 over the dataset's type, length and FINGERPRINT_ITEMS of its items (their
    tensors' bytes, else their repr): a changed or reordered dataset shows, at the cost of a few reads."""
    hasher = blake3.blake3(f"{type(dataset).__qualname__}:{len(dataset)}".encode())
    length = len(dataset)
    if length and hasattr(dataset, "__getitem__"):
        for index in sorted({int(i) for i in np.linspace(0, length - 1, min(FINGERPRINT_ITEMS, length))}):
            _feed(hasher, dataset[index])
    return hasher.hexdigest(16)


def _feed(hasher: Any, item: Any) -> None:
    if isinstance(item, torch.Tensor):
        hasher.update(f"{item.dtype}{tuple(item.shape)}".encode())
        hasher.update(item.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(item, np.ndarray):
        hasher.update(np.ascontiguousarray(item).tobytes())
    elif isinstance(item, (tuple, list)):
        for each in item:
            _feed(hasher, each)
    elif isinstance(item, dict):
        for key in sorted(item, key=repr):
            hasher.update(repr(key).encode())
            _feed(hasher, item[key])
    else:
        hasher.update(repr(item).encode())
