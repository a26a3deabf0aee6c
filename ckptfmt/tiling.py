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
from typing import Protocol

import numpy as np

from .errors import ManifestError

#: Non-empty shards a tensor may have without forming a grid.
PAIRWISE_LIMIT = 256
#: Candidate pairs compared at once (bounds the sweep's temporary arrays to a few MB).
_PAIR_BLOCK = 4096


class Box(Protocol):
    offsets: tuple[int, ...]
    shape: tuple[int, ...]


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
    if len(solid) <= 1 or _is_grid(shape, solid):
        return
    if len(solid) > PAIRWISE_LIMIT:
        raise ManifestError(f"{what}: more than {PAIRWISE_LIMIT} shards that do not form a grid")
    _check_disjoint(what, solid)


def _is_grid(shape: tuple[int, ...], boxes: Sequence[Box]) -> bool:
    """Whether the boxes are exactly the Cartesian product of per-dimension intervals tiling ``shape``."""
    cells = {tuple(zip(b.offsets, b.shape)) for b in boxes}
    if len(cells) != len(boxes):
        return False
    count = 1
    for dim, extent in enumerate(shape):
        position = 0
        intervals = sorted({cell[dim] for cell in cells})
        for start, length in intervals:
            if start != position:
                return False
            position += length
        if position != extent:
            return False
        count *= len(intervals)
    return count == len(cells)


def _check_disjoint(what: str, boxes: Sequence[Box]) -> None:
    """Raise on the first two boxes that overlap; a sweep along the most spread dimension."""
    low = np.array([b.offsets for b in boxes], dtype=np.int64)
    high = low + np.array([b.shape for b in boxes], dtype=np.int64)  # no overflow: inside a valid shape
    spread = [len(np.unique(low[:, d])) for d in range(low.shape[1])]
    dim = int(np.argmax(spread))
    order = np.argsort(low[:, dim], kind="stable")
    low, high = low[order], high[order]
    # Box i can only overlap the boxes after it in sweep order that start before it ends.
    ends = np.searchsorted(low[:, dim], high[:, dim], side="left")
    index = np.arange(len(boxes))
    counts = np.maximum(ends - index - 1, 0)
    first = np.repeat(index, counts)
    second = np.repeat(index + 1 - (np.cumsum(counts) - counts), counts) + np.arange(int(counts.sum()))
    for block in range(0, len(first), _PAIR_BLOCK):
        a, b = first[block : block + _PAIR_BLOCK], second[block : block + _PAIR_BLOCK]
        overlap = np.all((low[a] < high[b]) & (low[b] < high[a]), axis=1)
        if overlap.any():
            hit = int(np.argmax(overlap))
            raise ManifestError(f"{what}: shards at {low[a[hit]].tolist()} and {low[b[hit]].tolist()} overlap")
