"""Records of columns as a manifest stores them (spec 9.4: a rank's steps, its system samples): a map
with a ``count`` and columns of that many little-endian values as bytes, read back as numpy arrays
without a copy, every length checked."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ckptfmt.errors import ManifestError


def record_count(record: Any, where: str) -> int:
    """The ``count`` of a stored column record (a map), or a ManifestError naming ``where``."""
    if not isinstance(record, dict):
        raise ManifestError(f"{where}: not a map")
    count = record.get("count")
    if type(count) is not int or count < 0:
        raise ManifestError(f"{where}: count is not a non-negative int")
    return count


def column_reader(count: int, where: str) -> Callable[..., np.ndarray]:
    """What reads a column of the record at ``where``: ``column(value, what, dtype, width=1)``, ``count``
    rows of ``width`` values of ``dtype`` from ``value``'s bytes, any other length refused."""
    def column(value: Any, what: str, dtype: np.dtype, width: int = 1) -> np.ndarray:
        if type(value) is not bytes or len(value) != count * width * dtype.itemsize:
            raise ManifestError(f"{where}: {what} is not {count * width} {dtype.name} values as bytes")
        array = np.frombuffer(value, dtype=dtype)
        return array.reshape(count, width) if width > 1 else array
    return column
