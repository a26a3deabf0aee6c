"""The kernels in numpy: what runs where the C extension was not built, with results identical to it
(tests/kernels/ compares them on every dtype, odd lengths, NaN payloads, signed zeros, denormals).

The sums are taken in the C kernel's order of lanes (``lane_sum``); the rest is exact.
"""

from __future__ import annotations

import numpy as np

#: Elements rotated or interleaved at a time: a block and its scratch stay in the CPU's cache, which
#: makes the float codec's numpy passes 1.2-1.6x faster than over whole arrays (bench/float_codec.py).
_BLOCK = 1 << 16

#: Element ``i`` of a block is summed in lane ``i % LANES`` (c_kernels.c says why, and the order).
LANES = 64


def widen(raw: np.ndarray, kind: str, table: np.ndarray | None) -> np.ndarray:
    """The float64 values of ``raw`` (a 1-D array of the kind's item size; see ``float_block``)."""
    if kind == "d":
        return raw.view(np.float64)
    if kind == "f":
        return raw.view(np.float32).astype(np.float64)
    if kind == "b":
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    assert table is not None, f"float kind {kind} reads through a table"
    return table[raw.view(np.uint16 if kind == "e" else np.uint8)]


def lane_sum(wide: np.ndarray) -> float:
    """The binary64 sum of ``wide`` in the kernels' order: element ``i`` added to lane ``i % LANES`` (each
    lane a sequential sum: numpy's add.reduce over the first axis adds row after row), the lanes folded
    in halves, then +0.0 + lane 0. A lane begun from its first element rather than +0.0 differs at most
    in the sign of a zero, which the final +0.0 removes."""
    whole = len(wide) - len(wide) % LANES
    lanes = np.add.reduce(wide[:whole].reshape(-1, LANES), axis=0) if whole else np.zeros(LANES)
    lanes[: len(wide) - whole] += wide[whole:]
    while len(lanes) > 1:
        half = len(lanes) // 2
        lanes = lanes[:half] + lanes[half:]
    return 0.0 + float(lanes[0])


def float_block(raw: np.ndarray, kind: str, table: np.ndarray | None) -> tuple[float, float, float, float, int, int]:
    wide = widen(raw, kind, table)
    with np.errstate(all="ignore"):  # NaN, infinities, overflow: the caller sees non-finite sums
        total = lane_sum(wide)
        squares = lane_sum(wide * wide)
    zero = wide == 0
    return (total, squares, float(wide.min()), float(wide.max()), int(np.count_nonzero(zero)),
            int(np.count_nonzero(zero & np.signbit(wide))))


def int_block(raw: np.ndarray) -> tuple[int, int, int]:
    return int(raw.min()), int(raw.max()), int(raw.size - np.count_nonzero(raw))


def split_planes(values: np.ndarray, planes: np.ndarray) -> None:
    """``planes[j]`` = byte ``j`` of every element of ``values`` (a uint array) rotated left by one bit.
    Bytes of 2-byte elements are taken by shifting and casting (2.3x faster than a strided copy, which is
    faster for 4 and 8 bytes)."""
    width, total = values.itemsize, len(values)
    scratch = np.empty((2, min(_BLOCK, total)), dtype=values.dtype)
    for start in range(0, total, _BLOCK):
        block = values[start : start + _BLOCK]
        rotated, spare = scratch[0, : len(block)], scratch[1, : len(block)]
        np.right_shift(block, 8 * width - 1, out=rotated)
        np.left_shift(block, 1, out=spare)
        np.bitwise_or(rotated, spare, out=rotated)
        where = slice(start, start + len(block))
        if width == 2:
            np.copyto(planes[0, where], rotated, casting="unsafe")  # the cast keeps the low byte
            np.right_shift(rotated, 8, out=spare)
            np.copyto(planes[1, where], spare, casting="unsafe")
        else:
            rotated_bytes = rotated.view(np.uint8).reshape(len(block), width)
            for j in range(width):
                planes[j, where] = rotated_bytes[:, j]


def join_planes(planes: list[np.ndarray], values: np.ndarray) -> None:
    """Inverse of ``split_planes``: each element of ``values`` (a uint array) from its bytes in ``planes``,
    rotated back right by one bit; 2-byte elements by shifting and or-ing (1.4x faster than strided writes,
    which are faster for 4 and 8 bytes)."""
    width, total = values.itemsize, len(values)
    scratch = np.empty(min(_BLOCK, total), dtype=values.dtype)
    for start in range(0, total, _BLOCK):
        block = values[start : start + _BLOCK]
        where = slice(start, start + len(block))
        if width == 2:
            np.copyto(block, planes[1][where])
            np.left_shift(block, 8, out=block)
            np.bitwise_or(block, planes[0][where], out=block)
        else:
            block_bytes = block.view(np.uint8).reshape(len(block), width)
            for j, plane in enumerate(planes):
                block_bytes[:, j] = plane[where]
        low = scratch[: len(block)]
        np.left_shift(block, 8 * width - 1, out=low)  # bit 0 (the sign) back to the top
        np.right_shift(block, 1, out=block)
        np.bitwise_or(block, low, out=block)


__all__ = ["float_block", "int_block", "join_planes", "split_planes", "widen"]
