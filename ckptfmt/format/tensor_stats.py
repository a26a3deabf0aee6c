"""Tensor statistics (spec 6.10): the fields each kind of tensor records, and the exact merge of parts.

For a floating-point tensor: ``count`` (elements), ``min``, ``max``, ``mean``, ``l2`` (the Euclidean
norm) and ``absmax`` over its finite elements (None where it has none), and the counts ``nan``,
``posinf``, ``neginf`` and ``zeros`` (exact zeros, either sign); -0.0 is below +0.0 for ``min`` and
``max``, so a zero extreme's sign does not depend on the elements' order. For an integer or bool tensor:
``count``, ``min``, ``max`` and ``zeros``. Dtypes without arithmetic (packed float4, the ``bits`` kinds)
and complex tensors get ``count`` alone. Merging the statistics of parts (``merge_stats``: the chunks
of one shard, the shards of one tensor) gives the whole tensor's figures to float64 rounding: counts
add, extremes take the extreme, the mean is weighted by each part's finite elements and the norm is
the root of the summed squares. Taking them from tensors is the torch side's (``tensors/stats.py``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Iterator, KeysView, Mapping
from typing import Any

FLOAT_FIELDS = ("count", "min", "max", "mean", "l2", "absmax", "nan", "posinf", "neginf", "zeros")
INTEGER_FIELDS = ("count", "min", "max", "zeros")
COUNT_FIELDS = ("count",)


_FLOAT_DTYPES = frozenset({"float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e4m3fnuz",
                           "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu"})
_INTEGER_DTYPES = frozenset({"bool", "uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64"})


@functools.cache
def stat_sets(dtype: str) -> tuple[frozenset, ...]:
    """The statistics sets a tensor of ``dtype`` may carry (spec 6.10): its own, or the count alone."""
    if dtype in _FLOAT_DTYPES:
        return frozenset(FLOAT_FIELDS), frozenset(COUNT_FIELDS)
    if dtype in _INTEGER_DTYPES:
        return frozenset(INTEGER_FIELDS), frozenset(COUNT_FIELDS)
    return (frozenset(COUNT_FIELDS),)


class StatsRow(Mapping):
    """One tensor's statistics as a row of columns (an array per field, numpy's) that many share.

    A save of many small tensors reduces each pack of them at once (tensors/stats.py): a dict and its
    floats per tensor held some 35 MiB resident in a save of 100,000 tensors of 8 floats until its
    manifest was written, and a row is 48 bytes. It reads as the dict of the same fields in the same
    order (Python numbers), pickles as that dict, and is never changed; the manifest's writer takes the
    cells of many rows from their columns at once (format/tensor_columns.py).
    """

    __slots__ = ("columns", "at")

    def __init__(self, columns: dict[str, Any], at: int):
        self.columns = columns
        self.at = at

    def __getitem__(self, name: str) -> Any:
        return self.columns[name].item(self.at)

    def __iter__(self) -> Iterator[str]:
        return iter(self.columns)

    def __len__(self) -> int:
        return len(self.columns)

    def keys(self) -> KeysView[str]:
        return self.columns.keys()

    def __reduce__(self) -> tuple:
        return dict, (dict(self),)

    def __repr__(self) -> str:
        return repr(dict(self))


def lower(a, b):
    """The smaller extreme, -0.0 below +0.0 whichever comes first (``min`` keeps the first of equals)."""
    return a if a < b or (a == b and math.copysign(1.0, a) < 0) else b


def higher(a, b):
    """The larger extreme, +0.0 above -0.0 whichever comes first."""
    return a if a > b or (a == b and math.copysign(1.0, a) > 0) else b


def merge_stats(parts: Iterable[Mapping[str, Any]]) -> Mapping[str, Any]:
    """The statistics of the elements of every part together (the shards of one tensor)."""
    parts = list(parts)
    if len(parts) == 1:  # the part's own map, not a copy: statistics are never changed once taken
        return parts[0]
    if not parts:
        raise ValueError("merge_stats needs at least one part")
    fields = set(parts[0])
    if any(set(part) != fields for part in parts):
        raise ValueError("merge_stats: the parts hold different fields (statistics of different dtypes)")
    merged: dict[str, Any] = {"count": sum(part["count"] for part in parts)}
    for name in ("nan", "posinf", "neginf", "zeros"):
        if name in fields:
            merged[name] = sum(part[name] for part in parts)
    for name, pick in (("min", lower), ("max", higher), ("absmax", higher)):
        if name in fields:
            present = [part[name] for part in parts if part[name] is not None]
            merged[name] = functools.reduce(pick, present) if present else None
    if "mean" in fields:
        finite = [(_finite(part), part) for part in parts]
        total = sum(n for n, _ in finite)
        # Weights of at most 1, so that means near float64's largest value do not overflow.
        merged["mean"] = math.fsum(part["mean"] * (n / total) for n, part in finite if n) if total else None
        merged["l2"] = math.hypot(*(part["l2"] for n, part in finite if n)) if total else None
    order = FLOAT_FIELDS if "mean" in fields else INTEGER_FIELDS if "min" in fields else COUNT_FIELDS
    return {name: merged[name] for name in order}


def _finite(part: Mapping[str, Any]) -> int:
    return part["count"] - part["nan"] - part["posinf"] - part["neginf"]
