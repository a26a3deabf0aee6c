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

The integrations (Lightning's ``StepTimingCallback``) find a ``ResumableSampler``
in the training loader, save its position with each checkpoint and restore it
on resume, at any world size. Whatever the sampler, they record the loader's
data position and contract (``data_position``) and check, on resume, that the
position was restored (``check_position``), so that a framework restarting an
epoch from its start is on a resume's record.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sized
from typing import Any

import blake3
import numpy as np
import torch

from ckptfmt.errors import CheckpointError
from ckptfmt.loading.resume_check import PartCheck

#: The contract's fields a resume must keep: another value would not continue the order consumed.
KEPT = ("seed", "shuffle", "dataset_length", "dataset_fingerprint")
#: Where a data position stands: the epoch, the samples of its order consumed, and the order itself. A
#: resume restores these; the world size, batch size and workers may change.
POSITION = ("epoch", "consumed", *KEPT)
#: Items of the dataset the fingerprint reads (first, last and evenly between).
FINGERPRINT_ITEMS = 16
#: Fingerprints of the datasets seen, so that a save does not read their items again.
_FINGERPRINTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class ResumableSampler(torch.utils.data.Sampler):
    """This rank's batches of each epoch's global order, from a position saved at any world size."""

    def __init__(self, dataset: Sized, batch_size: int, *, num_replicas: int | None = None, rank: int | None = None,
                 seed: int = 0, shuffle: bool = True, workers: int = 0):
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, not {batch_size}")
        #: As given; None: torch.distributed's when asked (a framework may join the group after the
        #: loader is made, as Lightning does).
        self._num_replicas, self._rank = num_replicas, rank
        if num_replicas is not None and rank is not None and not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is not one of {num_replicas} replicas")
        self.dataset_length = len(dataset)
        self.dataset_fingerprint = fingerprint(dataset)
        self.batch_size, self.seed, self.shuffle, self.workers = batch_size, seed, shuffle, workers
        self.epoch = 0
        #: Samples of this epoch's order consumed by the job before this sampler's iteration began.
        self.start = 0
        #: Batches this rank's iteration has handed out since.
        self.handed = 0

    @property
    def num_replicas(self) -> int:
        if self._num_replicas is not None:
            return self._num_replicas
        return torch.distributed.get_world_size() if _joined() else 1

    @property
    def rank(self) -> int:
        rank = self._rank if self._rank is not None else torch.distributed.get_rank() if _joined() else 0
        if not 0 <= rank < self.num_replicas:
            raise ValueError(f"rank {rank} is not one of {self.num_replicas} replicas")
        return rank

    @property
    def sampler(self) -> ResumableSampler:
        """Itself, where a ``BatchSampler`` has its sampler: the frameworks that call ``set_epoch`` on a
        loader's ``batch_sampler.sampler`` (Lightning, Accelerate) set this one's epoch."""
        return self

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.num_replicas

    def __len__(self) -> int:
        """This rank's batches left in the epoch."""
        return max(self.dataset_length - self.start, 0) // self.global_batch

    def finished(self, consumed: int) -> bool:
        """Whether an epoch with ``consumed`` samples consumed has no global batch left."""
        return self.dataset_length - consumed < self.global_batch

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


def _joined() -> bool:
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized()


def resumable(loader: Any) -> ResumableSampler | None:
    """The ``ResumableSampler`` a data loader draws its batches from (its batch sampler, or its sampler)."""
    for owner in (getattr(loader, "batch_sampler", None), getattr(loader, "sampler", None)):
        if isinstance(owner, ResumableSampler):
            return owner
    return None


def data_position(loader: Any, batches: int, epoch: int) -> dict[str, Any] | None:
    """A training loader's data position once the loop consumed ``batches`` of its current iteration,
    with its sampler's contract (the fields of ``ResumableSampler.state_dict``, plus ``resumable``);
    None for a loader of no sized dataset. ``epoch``: the loop's (a sampler without epochs has none).

    A ``ResumableSampler``'s position counts from where its iteration began; any other sampler's
    iteration begins at its epoch's start (``DistributedSampler``, ``RandomSampler``: the samples of
    ``batches`` global batches). A finished epoch is the next epoch's start."""
    sampler = resumable(loader)
    if sampler is not None:
        state = sampler.state_dict(batches=batches)
        finished = sampler.finished(state["consumed"])
    else:
        dataset, inner = getattr(loader, "dataset", None), getattr(loader, "sampler", None)
        if dataset is None or not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
            return None
        replicas = getattr(inner, "num_replicas", 1)
        per_rank = getattr(loader, "batch_size", None) or 1
        shuffle = getattr(inner, "shuffle", isinstance(inner, torch.utils.data.RandomSampler))
        state = {"epoch": getattr(inner, "epoch", epoch), "consumed": batches * per_rank * replicas,
                 "seed": getattr(inner, "seed", None), "shuffle": bool(shuffle), "dataset_length": len(dataset),
                 "dataset_fingerprint": fingerprint(dataset), "num_replicas": replicas, "batch_size": per_rank,
                 "workers": getattr(loader, "num_workers", 0)}
        finished = hasattr(loader, "__len__") and batches >= len(loader)
    if finished:
        state["epoch"], state["consumed"] = state["epoch"] + 1, 0
    state["resumable"] = sampler is not None
    return state


def check_position(stored: Any, live: dict[str, Any] | None) -> PartCheck:
    """The ``data_position`` part of a resume's record: the loader's position once the resume was done
    against the one the checkpoint stored (``POSITION``'s fields; world and batch sizes may change)."""
    check = PartCheck("data_position", "equal", stored=len(POSITION) if isinstance(stored, dict) else 0,
                      feeds="batches")
    if not check.stored:
        check.verdict = "not stored"
        return check
    for name in POSITION:
        if live is None or name not in live:
            check.missing += 1
            check.keys.append(name)
        elif live[name] != stored.get(name):
            check.different += 1
            check.keys.append(f"{name} was {stored.get(name)!r}, is {live[name]!r}")
    check.verdict = "missing" if check.missing else "different" if check.different else "equal"
    return check


def fingerprint(dataset: Sized) -> str:
    """32 hex digits of BLAKE3 over the dataset's type, length and FINGERPRINT_ITEMS of its items (their
    tensors' bytes, else their repr): a changed or reordered dataset shows, at the cost of a few reads
    (once per dataset object)."""
    try:
        return _FINGERPRINTS[dataset]
    except (KeyError, TypeError):  # not seen, or not weakly referable
        pass
    hasher = blake3.blake3(f"{type(dataset).__qualname__}:{len(dataset)}".encode())
    length = len(dataset)
    if length and hasattr(dataset, "__getitem__"):
        for index in sorted({int(i) for i in np.linspace(0, length - 1, min(FINGERPRINT_ITEMS, length))}):
            _feed(hasher, dataset[index])
    found = hasher.hexdigest(16)
    try:
        _FINGERPRINTS[dataset] = found
    except TypeError:
        pass
    return found


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
