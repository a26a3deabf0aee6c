"""A tensor table entry (spec 6.4): what a reader knows of one tensor of the state, whichever form
(rows of maps, or columns, spec 6.12) the manifest holds it in."""

from __future__ import annotations

import math
from typing import NamedTuple

from ckptfmt.format.dtypes import itemsize
from ckptfmt.format.shards import ShardEntry, ShardGrid

#: What a loader rebuilds (spec 6.8), in the order the tensor columns number them (spec 6.12).
TENSOR_KINDS = ("tensor", "parameter", "numpy")


class TensorEntry(NamedTuple):
    """A tensor of the state: key, dtype, global shape, and the shards that tile it."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    #: One ``ShardEntry`` per box, or (format 1.6, many shards) a ``ShardGrid`` of packed columns.
    shards: tuple[ShardEntry, ...] | ShardGrid
    kind: str = "tensor"
    requires_grad: bool = False
    same_as: int | None = None
    #: The statistics of its elements (spec 6.10, format 1.4), or None where not recorded.
    stats: dict | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * itemsize(self.dtype)
