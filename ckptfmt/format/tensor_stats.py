"""Tensor statistics: what a tensor's values look like, computed per stored shard and merged exactly.

For a floating-point tensor: ``count`` (elements), ``min``, ``max``, ``mean``, ``l2`` (the Euclidean
norm) and ``absmax`` over its finite elements (None where it has none), and the counts ``nan``,
``posinf``, ``neginf`` and ``zeros`` (exact zeros, either sign). For an integer or bool tensor:
``count``, ``min``, ``max`` and ``zeros``. Sums accumulate in float64, a block of elements at a time
(memory stays bounded whatever the tensor's size), so merging the shards' statistics
(``merge_stats``) gives the whole tensor's figures to float64 rounding: counts add, extremes take
the extreme, the mean is weighted by each shard's finite elements and the norm is the root of the
summed squares. Dtypes without arithmetic on this machine (packed float4, complex) get ``count``
alone.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from typing import Any

import torch

FLOAT_FIELDS = ("count", "min", "max", "mean", "l2", "absmax", "nan", "posinf", "neginf", "zeros")
INTEGER_FIELDS = ("count", "min", "max", "zeros")
#: Elements converted to float64 at a time: 8 MiB of scratch per block.
BLOCK_ELEMENTS = 1 << 20


def tensor_stats(tensor: torch.Tensor, *, block: int = BLOCK_ELEMENTS) -> dict[str, Any]:
    """``tensor``'s statistics (the fields above for its kind), from one pass over its elements."""
    flat = tensor.detach().reshape(-1)
    if tensor.dtype.is_complex or not _has_arithmetic(tensor.dtype):
        return {"count": flat.numel()}
    if not tensor.dtype.is_floating_point:
        return _integer_stats(flat, block)
    return _float_stats(flat, block)


def merge_stats(parts: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """The statistics of the elements of every part together (the shards of one tensor)."""
    parts = list(parts)
    if not parts:
        raise ValueError("merge_stats needs at least one part")
    fields = set(parts[0])
    if any(set(part) != fields for part in parts):
        raise ValueError("merge_stats: the parts hold different fields (statistics of different dtypes)")
    merged: dict[str, Any] = {"count": sum(part["count"] for part in parts)}
    for name in ("nan", "posinf", "neginf", "zeros"):
        if name in fields:
            merged[name] = sum(part[name] for part in parts)
    for name, pick in (("min", min), ("max", max), ("absmax", max)):
        if name in fields:
            present = [part[name] for part in parts if part[name] is not None]
            merged[name] = pick(present) if present else None
    if "mean" in fields:
        finite = [(_finite(part), part) for part in parts]
        total = sum(n for n, _ in finite)
        merged["mean"] = (math.fsum(part["mean"] * n for n, part in finite if n) / total) if total else None
        merged["l2"] = math.sqrt(math.fsum(part["l2"] ** 2 for n, part in finite if n)) if total else None
    return {name: merged[name] for name in (FLOAT_FIELDS if "mean" in fields else INTEGER_FIELDS)
            if name in merged}


def _float_stats(flat: torch.Tensor, block: int) -> dict[str, Any]:
    count, nan, posinf, neginf, zeros, finite = flat.numel(), 0, 0, 0, 0, 0
    total = squares = 0.0
    low = high = peak = None
    for start in range(0, count, block):
        values = flat[start:start + block]
        if not _arithmetic_in_place(values.dtype):
            values = values.to(torch.float64)
        zeros += int((values == 0).sum())
        if not bool(torch.isfinite(values).all()):  # the rare block: count and drop what is not finite
            is_nan, is_inf = torch.isnan(values), torch.isinf(values)
            nan += int(is_nan.sum())
            posinf += int((is_inf & (values > 0)).sum())
            neginf += int((is_inf & (values < 0)).sum())
            values = values[~(is_nan | is_inf)]
            if values.numel() == 0:
                continue
        finite += values.numel()
        total += float(torch.sum(values, dtype=torch.float64))
        squares += float(torch.linalg.vector_norm(values, dtype=torch.float64)) ** 2
        smallest, largest = torch.aminmax(values)  # exact in the tensor's own dtype
        low = _extreme(min, low, float(smallest))
        high = _extreme(max, high, float(largest))
        peak = _extreme(max, peak, max(-float(smallest), float(largest)))
    return {"count": count, "min": low, "max": high, "mean": total / finite if finite else None,
            "l2": math.sqrt(squares) if finite else None, "absmax": peak,
            "nan": nan, "posinf": posinf, "neginf": neginf, "zeros": zeros}


def _integer_stats(flat: torch.Tensor, block: int) -> dict[str, Any]:
    low = high = None
    zeros = 0
    for start in range(0, flat.numel(), block):
        values = flat[start:start + block]
        if values.dtype == torch.bool:
            values = values.to(torch.uint8)
        zeros += int((values == 0).sum())
        low = _extreme(min, low, int(values.min()))
        high = _extreme(max, high, int(values.max()))
    return {"count": flat.numel(), "min": low, "max": high, "zeros": zeros}


def _extreme(pick, current, value):
    return value if current is None else pick(current, value)


def _finite(part: dict[str, Any]) -> int:
    return part["count"] - part["nan"] - part["posinf"] - part["neginf"]


@functools.cache
def _arithmetic_in_place(dtype: torch.dtype) -> bool:
    """Whether torch reduces ``dtype`` itself (float8 kinds are converted to float64 first)."""
    try:
        probe = torch.zeros(8, dtype=torch.uint8).view(dtype)
        torch.aminmax(probe), torch.sum(probe, dtype=torch.float64), torch.isfinite(probe)
        torch.linalg.vector_norm(probe, dtype=torch.float64)
    except (RuntimeError, TypeError):
        return False
    return True


@functools.cache
def _has_arithmetic(dtype: torch.dtype) -> bool:
    """Whether this torch converts ``dtype`` to float64 (packed float4 has no element-wise copy)."""
    try:
        torch.zeros(8, dtype=torch.uint8).view(dtype).to(torch.float64)
    except (RuntimeError, TypeError):
        return False
    return True
