"""ckptfmt's hot loops over bytes: C where the package's build compiled its extension (``c_kernels.c``),
numpy otherwise, with identical results either way (tests/kernels/). Chosen once, at import;
``CKPTFMT_KERNELS=numpy`` in the environment chooses numpy even where the extension is there.

They hold arithmetic only, over buffers the caller has validated: a block's statistics (the float64
sum and sum of squares, extremes, zeros and negative zeros), and the float codec's planes (spec 5.3).
Nothing here parses what a file says. ``keys.py`` (its own C module, ``c_keys.c``) checks a manifest's
keys once msgpack has decoded them: lengths, and no two alike.
"""

from __future__ import annotations

import functools
import os

import numpy as np

from ckptfmt.kernels import numpy_kernels

try:
    from ckptfmt.kernels import c_kernels as _native  # type: ignore[attr-defined]  # built, not in the source
except ImportError as exc:  # an sdist built without a C compiler: the numpy kernels, said by describe()
    _native = None
    _MISSING = f"the C extension is not built ({exc})"
else:
    _MISSING = ""
if _native is not None and os.environ.get("CKPTFMT_KERNELS") == "numpy":
    _native, _MISSING = None, "CKPTFMT_KERNELS=numpy"

#: Whether the C kernels run.
NATIVE = _native is not None
#: Float kinds: "d" float64, "f" float32, "b" bfloat16; "e" 16-bit and "t" 8-bit floats through a table of
#: every bit pattern's float64 value (``fp16_table``, or the caller's for the 8-bit formats).
FLOAT_KINDS = ("d", "f", "b", "e", "t")
_INT_KINDS = {np.dtype(np.int8): "b", np.dtype(np.uint8): "B", np.dtype(np.int16): "h", np.dtype(np.int32): "i",
              np.dtype(np.int64): "q"}


def describe() -> str:
    """Which kernels run, in words (``ckptfmt --version``)."""
    return f"native (C, {_native.vectors()} vectors)" if _native is not None else f"numpy ({_MISSING})"


@functools.cache
def fp16_table() -> np.ndarray:
    """The float64 value of every IEEE half bit pattern (numpy's conversion: exact)."""
    return np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float64)


def float_block(raw: np.ndarray, kind: str, table: np.ndarray | None = None) -> tuple[float, float, float, float,
                                                                                      int, int]:
    """One block of at least one float element: (sum, sum of squares, min, max, zeros, negative zeros).
    ``raw`` is a contiguous 1-D array of the kind's elements (any dtype of that item size); kind "e" is
    IEEE half, whatever the table. The sums are binary64 in the kernels' order of lanes (c_kernels.c);
    when the block holds NaN or infinities, or its sums overflow, they are not finite and the extremes
    are unspecified. A zero extreme may be either zero (the caller knows from the counts which zeros
    there are)."""
    if kind == "e" and table is None:
        table = fp16_table()
    if _native is not None:
        return _native.float_block(raw, kind, table)
    return numpy_kernels.float_block(raw, kind, table)


def int_block(raw: np.ndarray) -> tuple[int, int, int]:
    """One block of at least one integer element, a contiguous 1-D array: (min, max, zeros)."""
    kind = _INT_KINDS.get(raw.dtype)
    if _native is not None and kind is not None:
        return _native.int_block(raw, kind)
    return numpy_kernels.int_block(raw)


def split_planes(values: np.ndarray, planes: np.ndarray) -> None:
    """``planes[j]`` (a C-contiguous (width, count) uint8 array) = byte ``j`` of every element of ``values``
    (a contiguous uint array of width 2, 4 or 8) rotated left by one bit (spec 5.3)."""
    if _native is not None:
        _native.split_planes(values, values.itemsize, planes)
    else:
        numpy_kernels.split_planes(values, planes)


def join_planes(planes: list[np.ndarray], values: np.ndarray) -> None:
    """Inverse of ``split_planes``: ``values`` from its planes, one uint8 array of ``len(values)`` each."""
    if _native is not None:
        _native.join_planes(planes, values.itemsize, values)
    else:
        numpy_kernels.join_planes(planes, values)


__all__ = ["FLOAT_KINDS", "NATIVE", "describe", "float_block", "fp16_table", "int_block", "join_planes",
           "split_planes"]
