"""Do a tensor's shards tile it exactly? Checked in time linear in the shards for grids.

A manifest may claim any layout, so the check must cost about as much as the
bytes that describe it (spec 6.5, 14). Grids (every box a product of one
interval per dimension, which is what row-, column- and block-wise
parallelism produces) are recognised in linear time. Other layouts are allowed
up to ``PAIRWISE_LIMIT`` non-empty shards and checked for overlaps by a sweep
along their most spread dimension, vectorised with numpy, so that even a
hostile layout costs a few operations per integer of the manifest.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from ckptfmt.errors import ManifestError

if TYPE_CHECKING:  # numpy is imported where it is used: not to list or describe a checkpoint
    import numpy as np

#: Non-empty shards a tensor may have without forming a grid.
PAIRWISE_LIMIT = 256
#: Candidate pairs compared at once (bounds the sweep's temporary arrays to a few MB).
_PAIR_BLOCK = 4096


class Box(Protocol):
    """Where a shard lies: its offsets in the global tensor and its shape (read-only, as in frozen dataclasses)."""

    @property
    def offsets(self) -> tuple[int, ...]: ...

    @property
    def shape(self) -> tuple[int, ...]: ...


def check_tiling(what: str, shape: tuple[int, ...], boxes: Sequence[Box]) -> None:
    """Raise ManifestError unless ``boxes`` (each inside ``shape``) cover it with no overlap.

    Equal volumes plus no overlap means every element is covered exactly once.
    """
    if len(boxes) == 1 and tuple(boxes[0].shape) == tuple(shape):
        return  # one box as large as the tensor, and inside it: the usual case
    volumes = [math.prod(b.shape) for b in boxes]
    if sum(volumes) != math.prod(shape):
        raise ManifestError(f"{what}: shards do not cover shape {list(shape)} exactly")
    solid = [b for b, volume in zip(boxes, volumes) if volume]  # empty boxes overlap nothing
    if len(solid) <= 1:
        return
    import numpy as np  # several boxes: checked as arrays

    low = np.array([b.offsets for b in solid], dtype=np.int64)
    high = low + np.array([b.shape for b in solid], dtype=np.int64)  # no overflow: inside a valid shape
    if _is_grid(shape, low, high):
        return
    if len(solid) > PAIRWISE_LIMIT:
        raise ManifestError(f"{what}: more than {PAIRWISE_LIMIT} shards that do not form a grid")
    _check_disjoint(what, low, high)


def _is_grid(shape: tuple[int, ...], low: np.ndarray, high: np.ndarray) -> bool:
    """Whether the boxes [low, high) are exactly the Cartesian product of per-dimension intervals tiling ``shape``."""
    import numpy as np

    count = len(low)
    distinct = 1 + np.count_nonzero(np.diff(np.sort(low, axis=0), axis=0), axis=0)
    if math.prod(distinct.tolist()) != count:  # cheap refusal of most layouts that are not grids
        return False
    for dim, extent in enumerate(shape):
        starts, first = np.unique(low[:, dim], return_index=True)
        ends = high[first, dim]
        if starts[0] != 0 or ends[-1] != extent or np.any(starts[1:] != ends[:-1]):
            return False  # a gap or an overlap between this dimension's intervals
        if np.any(high[:, dim] != ends[np.searchsorted(starts, low[:, dim])]):
            return False  # two boxes start together in this dimension but end apart
    return len(np.unique(low, axis=0)) == count  # no cell twice


def _check_disjoint(what: str, low: np.ndarray, high: np.ndarray) -> None:
    """Raise on the first two boxes that overlap; a sweep along the most spread dimension."""
    import numpy as np

    spread = [len(np.unique(low[:, d])) for d in range(low.shape[1])]
    dim = int(np.argmax(spread))
    order = np.argsort(low[:, dim], kind="stable")
    low, high = low[order], high[order]
    # Box i can only overlap the boxes after it in sweep order that start before it ends.
    ends = np.searchsorted(low[:, dim], high[:, dim], side="left")
    index = np.arange(len(low))
    counts = np.maximum(ends - index - 1, 0)
    first = np.repeat(index, counts)
    second = np.repeat(index + 1 - (np.cumsum(counts) - counts), counts) + np.arange(int(counts.sum()))
    for block in range(0, len(first), _PAIR_BLOCK):
        a, b = first[block : block + _PAIR_BLOCK], second[block : block + _PAIR_BLOCK]
        overlap = np.all((low[a] < high[b]) & (low[b] < high[a]), axis=1)
        if overlap.any():
            hit = int(np.argmax(overlap))
            raise ManifestError(f"{what}: shards at {low[a[hit]].tolist()} and {low[b[hit]].tolist()} overlap")
