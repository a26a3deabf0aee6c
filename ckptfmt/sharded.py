"""A tensor given as shards: how a state hands ckptfmt a tensor that lives in pieces.

Converters (DCP, DeepSpeed) build these so a checkpoint keeps each shard with
its offsets and owning rank (spec 6.5) instead of a reassembled copy.
``ckptfmt.load`` returns the assembled tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Shard:
    """One box of a sharded tensor: where it starts in the global tensor, its data, its owner.

    ``rank`` is the rank that held the box in the run that produced it (a converter: the source
    run's rank), an integer in [0, 2**31-1]; it need not be a rank of the process that saves it.
    """

    offsets: tuple[int, ...]
    tensor: torch.Tensor
    rank: int = 0


@dataclass(frozen=True)
class Sharded:
    """A tensor of global ``shape`` made of ``shards`` that tile it exactly (no gaps, no overlaps)."""

    shape: tuple[int, ...]
    shards: tuple[Shard, ...]

    def __post_init__(self):
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        object.__setattr__(self, "shards", tuple(self.shards))
