"""Tensors that live in pieces: how a state hands ckptfmt a tensor it holds only part of.

Converters (DCP, DeepSpeed) build ``Sharded`` so a checkpoint keeps each shard
with its offsets and owning rank (spec 6.5) instead of a reassembled copy;
``ckptfmt.load`` returns the assembled tensor. ``LocalShard`` is one rank's part
of a DTensor in a collective save (made by ckptfmt/tensors/dtensors.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

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

    #: A value-tree leaf that goes to the tensor table (``format.values.is_tensor_leaf``).
    TENSOR_LEAF: ClassVar[bool] = True

    shape: tuple[int, ...]
    shards: tuple[Shard, ...]

    def __post_init__(self):
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        object.__setattr__(self, "shards", tuple(self.shards))


@dataclass(frozen=True)
class LocalShard:
    """This rank's part of a DTensor: its data and where it lies in the global tensor."""

    #: A value-tree leaf that goes to the tensor table (``format.values.is_tensor_leaf``).
    TENSOR_LEAF: ClassVar[bool] = True

    tensor: torch.Tensor
    offsets: tuple[int, ...]
    global_shape: tuple[int, ...]
    #: ``{"shape": [...], "dim_names": [...] or None}`` of the DTensor's device mesh.
    mesh: dict
    kind: str = "tensor"
    requires_grad: bool = False

    def with_tensor(self, tensor: torch.Tensor) -> LocalShard:
        """The same box holding other data (a staged copy)."""
        return LocalShard(tensor, self.offsets, self.global_shape, self.mesh, self.kind, self.requires_grad)
