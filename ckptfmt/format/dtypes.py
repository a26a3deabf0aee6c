"""The dtype table (spec 8): the format's names for tensor element types, and their item sizes.

Names are torch's own (``torch.float32`` -> ``"float32"``), but the table is the
format's and needs no torch: a manifest parses anywhere. The torch dtype of each
name is the torch side's (``ckptfmt/tensors/dtypes.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckptfmt.errors import ManifestError, quoted

if TYPE_CHECKING:  # numpy is imported where it is used: not to list or describe a checkpoint
    import numpy as np

#: format dtype name -> bytes per element (format version 1.0).
ITEMSIZES: dict[str, int] = {
    "bool": 1,
    "uint8": 1, "uint16": 2, "uint32": 4, "uint64": 8,
    "int8": 1, "int16": 2, "int32": 4, "int64": 8,
    "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8,
    "complex32": 4, "complex64": 8, "complex128": 16,
    "float8_e4m3fn": 1, "float8_e4m3fnuz": 1, "float8_e5m2": 1, "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1, "float4_e2m1fn_x2": 1,
    "bits8": 1, "bits16": 2, "bits1x8": 1, "bits2x4": 1, "bits4x2": 1,
}


def itemsize(name: str) -> int:
    """Bytes per element of a format dtype name; raises ManifestError for unknown names."""
    try:
        return ITEMSIZES[name]
    except (KeyError, TypeError):
        raise ManifestError(f"unknown dtype {quoted(name)} (written by a newer ckptfmt?)") from None


#: format dtype name -> the numpy dtype of the same bytes, where numpy has one (bfloat16: ``numeric``).
NUMPY_DTYPES: dict[str, str] = {
    "bool": "?", "uint8": "u1", "int8": "i1", "uint16": "<u2", "int16": "<i2", "uint32": "<u4", "int32": "<i4",
    "uint64": "<u8", "int64": "<i8", "float16": "<f2", "float32": "<f4", "float64": "<f8",
    "complex64": "<c8", "complex128": "<c16",
}


def numeric(raw: np.ndarray, name: str) -> np.ndarray | None:
    """Raw items of dtype ``name`` (an array of ``V<itemsize>``) as numbers numpy can compute with, without
    a copy where numpy has the dtype; bfloat16 widened exactly to float32; None for the dtypes numpy cannot
    represent (the float8 and float4 kinds, complex32, the bits kinds)."""
    import numpy as np

    if name in NUMPY_DTYPES:
        return raw.view(np.dtype(NUMPY_DTYPES[name]))
    if name == "bfloat16":  # the top half of a float32: shift the bits into place
        return (raw.view("<u2").astype("<u4") << 16).view("<f4")
    return None
