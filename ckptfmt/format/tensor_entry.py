"""A tensor table entry (spec 6.4): what a reader knows of one tensor of the state, whichever form
(rows of maps, or columns, spec 6.12) the manifest holds it in."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

from ckptfmt.errors import ManifestError
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


#: What a ``same_as`` entry must share with the entry it names: dtype, shape, kind, requires_grad, and no
#: ``same_as`` of its own (spec 6.9).
Likeness = tuple[str, tuple[int, ...], str, bool, int | None]


def likeness(entry: TensorEntry) -> Likeness:
    return entry.dtype, entry.shape, entry.kind, entry.requires_grad, entry.same_as


def check_table(keys: Sequence[str], entries: Iterable[TensorEntry], likeness_of: Callable[[int], Likeness]) -> None:
    """What a reader checks of a whole tensor table: no two ``keys`` alike, and each of ``entries`` with
    a ``same_as`` names an entry (``likeness_of(index)``) of the same dtype, shape, kind and
    requires_grad that has none."""
    if len(set(keys)) != len(keys):
        raise ManifestError("two tensors share one key")
    for entry in entries:
        if entry.same_as is not None and likeness_of(entry.same_as) != (*likeness(entry)[:4], None):
            raise ManifestError(f"tensor {entry.key!r}: same_as names a different tensor")
